"""Ports of launched servers held from the pick to the server's end, and the run's identity
token a launched server echoes back (issue 54: two jobs on one machine took each other's
servers).

A port that is free when it is picked is not free when the server binds it seconds later if
another job picked it too: both jobs' servers race for one port, the loser exits, and its job's
health check is answered by the winner. `PortHold` takes an exclusive `flock` on
`<tmp>/megatron-gspo-ports/<port>` for each port it hands out and keeps it until released
(when the servers stop, or when the process ends: the kernel drops an flock with its last file
descriptor). Every launch of this package on the machine picks through it, so no two take the
same port, whichever user runs them (the lock files are opened read-only: an flock needs no
write access). A process that does not take these locks (a job of another tool) is caught by the
token check below instead.

The token: SGLang's `--served-model-name` is echoed verbatim by `GET /server_info` in 0.5.12
(`dataclasses.asdict(server_args)`, entrypoints/http_server.py) and in 0.5.23
(`server_args.resolved_dict()`, utils/common.py `build_server_info`; a weight update from disk
moves the manager's copy reported by /model_info, not /server_info's). It only names the model
in the OpenAI-compatible API and in metrics labels, which this package does not use; SGLang
refuses a ':' in it (the LoRA adapter syntax).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import tempfile

#: where the per-port lock files live (machine-wide)
LOCK_DIR = os.path.join(tempfile.gettempdir(), "megatron-gspo-ports")
#: the launch argument that carries the run's token (SGLang ServerArgs.served_model_name)
TOKEN_FLAG = "--served-model-name"
TOKEN_FIELD = "served_model_name"
_TOKEN_RE = re.compile(r"^megatron-gspo-pid(\d+)-[0-9a-f]{12}$")


def new_run_token() -> str:
    """A token naming this launch: the launching process id and 48 random bits."""
    return f"megatron-gspo-pid{os.getpid()}-{secrets.token_hex(6)}"


def token_owner(value: object) -> str:
    """Whose server a /server_info `served_model_name` names, for an error message."""
    m = _TOKEN_RE.match(value) if isinstance(value, str) else None
    if m:
        return f"another megatron-gspo job's (launched by pid {m.group(1)})"
    return "not launched by megatron-gspo (no run token)"


def identity_error(url: str, info: dict, token: str) -> str | None:
    """One line when the server at `url` (its /server_info `info`) is not the one launched
    with `token`, else None."""
    got = info.get(TOKEN_FIELD)
    if got == token:
        return None
    return (f"{url} is not this run's server: its /server_info has {TOKEN_FIELD}={got!r}, "
            f"{token_owner(got)}, where this run launched {token!r} there (two jobs picked the "
            "same port and this run's server could not bind it?); nothing was sent to it")


class PortHold:
    """Exclusive machine-wide holds on ports (one flock per port) until `release`."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}

    @property
    def ports(self) -> list[int]:
        return sorted(self._fds)

    def take(self, port: int) -> bool:
        """Hold `port`; False when another holder (this process included) has it. A lock file
        that cannot be opened (no temporary directory) does not refuse the port."""
        if port in self._fds:
            return True
        try:
            os.makedirs(LOCK_DIR, exist_ok=True)
            try:
                os.chmod(LOCK_DIR, 0o1777)  # every user's jobs share it
            except OSError:
                pass
            fd = os.open(os.path.join(LOCK_DIR, str(port)), os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._fds[port] = fd
        return True

    def release(self, ports: list[int] | None = None) -> None:
        """Let `ports` go (None: all)."""
        for p in list(self._fds) if ports is None else ports:
            fd = self._fds.pop(p, None)
            if fd is not None:
                os.close(fd)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the kernel drops the locks
            pass
