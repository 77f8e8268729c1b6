"""Launched servers of a torchrun job on this node, kept so that a restarted round waits for the
dead round's servers to be gone, and their GPU memory back, before it launches its own.

SGLang sizes its KV cache from the GPU memory free when a server starts (see
megatron/memory/plan.py; model_runner_kv_cache_mixin.py in SGLang 0.5.12 / 0.5.23). torchrun
starts the next worker group as soon as the dead group's workers have exited; their servers live
in sessions of their own (`rollout/sglang/launch.py`), which the guard of `exec_with_parent`
SIGKILLs when their launcher dies, but a process that held tens of GiB of GPU memory takes a
while to exit, and a server launched meanwhile gets a smaller KV cache, or none.

- `before_launch()`: the launcher calls it before each server it starts. The first call of a
  restarted round (TORCHELASTIC_RESTART_COUNT > 0) waits, at most `WAIT_S`, until every server an
  earlier round recorded on this node is gone (its guard and every process of its session
  ended: a process exits its GPU memory before it is a zombie) and, where this process has
  CUDA initialized, until this GPU has as much memory available (free plus this process's own
  cache) as it had when the dead round launched its servers, less `slack`; it raises a RunError
  naming the pids and GPUs, or the GPU and its memory, when that does not happen in time.
  The first call of every round also notes this GPU's available memory for the next round.
- `add(pid, gpus, name)` after the server started; `forget(pid)` once it is stopped and its
  session is empty.

One record per torchrun agent on this node: TMPDIR/megatron_gspo_servers/<run id>-<agent pid>-
<agent start time>.json (the agent is the worker's parent, `restarts.die_with_agent`); every
round of the job has the same agent. Outside torchrun nothing is recorded and nothing waits.
Only the standard library is imported (torch only when the caller already imported it).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from megatron_gspo.runtime.exec_with_parent import session_members
from megatron_gspo.runtime.rundir import RunError

__all__ = ["WAIT_S", "record_path", "before_launch", "add", "forget", "wait_for_earlier_rounds",
           "available_bytes"]

WAIT_S = 180.0  # how long a restarted round waits for the dead round's servers
POLL_S = 0.1
_STATE: dict = {"round": None}  # the round whose first launch this process has handled


def _round() -> int:
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def _running(pid: int, start: int | None) -> bool:
    """The process `pid` started at `start` exists and is no zombie."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z" and (
        start is None or len(fields) <= 19 or int(fields[19]) == start)


def record_path() -> Path | None:
    """This node's record of the torchrun job (None outside torchrun)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or not sys.platform.startswith("linux"):
        return None
    agent = os.getppid()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)[:64]
    return (Path(tempfile.gettempdir()) / "megatron_gspo_servers"
            / f"{safe}-{agent}-{_start_time(agent)}.json")


@contextmanager
def _locked(path: Path):
    """Read-modify-write of the record under an exclusive lock; yields its entry list."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "a") as lock:  # one for every job: none left behind
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entries = json.loads(path.read_text()).get("servers", [])
        except (OSError, ValueError, AttributeError):
            entries = []
        out = list(entries)
        yield out
        if out == entries:
            return
        if out:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"servers": out}, indent=1))
            os.replace(tmp, path)
        else:
            path.unlink(missing_ok=True)


def available_bytes() -> tuple[int, int, int] | None:
    """(device, free bytes plus this process's cached ones, total bytes) of this process's CUDA
    device, where this process already initialized CUDA (nothing is initialized here)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    # the learner's device (LOCAL_RANK, `megatron.parallel.initialize`): servers are launched
    # from the engine's event-loop thread, whose current device is CUDA's default
    dev = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    free, total = torch.cuda.mem_get_info(dev)
    return dev, int(free) + int(torch.cuda.memory_reserved(dev)), int(total)


def _gone(e: dict) -> bool:
    return not _running(e["pid"], e.get("start")) and not session_members(e["pid"])


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def wait_for_earlier_rounds(path: Path, rnd: int, timeout_s: float = WAIT_S,
                            available=available_bytes) -> float:
    """Wait until the servers that rounds before `rnd` recorded in `path` are gone and this
    GPU's memory is back (see the module docstring); then drop them from the record.

    Args:
        path: the record.
        rnd: this round.
        timeout_s: the bound.
        available: () -> (device, available bytes, total bytes) or None (CPU).
    Returns:
        seconds waited.
    Raises:
        RunError (one line) naming what is still there after `timeout_s`.
    """
    t0 = time.monotonic()
    with _locked(path) as entries:
        old = [e for e in entries if e.get("round", 0) < rnd]
    if not old:
        return 0.0
    deadline = t0 + timeout_s
    while True:
        left = [e for e in old if not _gone(e)]
        if not left:
            break
        if time.monotonic() > deadline:
            what = ", ".join(f"{e.get('name', 'server')} pid {e['pid']} (GPUs "
                             f"{','.join(map(str, e.get('gpus') or [])) or '-'})" for e in left)
            raise RunError(
                f"automatic restart {rnd}: {len(left)} server(s) launched by round "
                f"{left[0].get('round', 0)} still run after {timeout_s:.0f} s: {what}; new "
                "servers would size their KV cache from the memory those hold: end them "
                "(kill -9 -PID ends the session) and launch again")
        time.sleep(POLL_S)
    now = available()
    want = [e["available"] for e in old
            if now is not None and e.get("device") == now[0] and e.get("available")]
    if want:
        target = max(want)  # what the dead round had when it launched
        while True:
            dev, avail, total = available()
            slack = max(2**30, total // 50)  # CUDA/NCCL state that differs between rounds
            if avail >= target - slack:
                break
            if time.monotonic() > deadline:
                raise RunError(
                    f"automatic restart {rnd}: GPU {dev} has {_gib(avail)} available after "
                    f"{timeout_s:.0f} s, {_gib(target)} when round {old[0].get('round', 0)} "
                    "launched its servers, which are gone; another process holds GPU "
                    f"{dev}'s memory (nvidia-smi lists it): end it and launch again")
            time.sleep(POLL_S)
    with _locked(path) as entries:
        entries[:] = [e for e in entries if e not in old]
    return time.monotonic() - t0


def before_launch(timeout_s: float | None = None) -> float:
    """Call before starting a server: the first call of a restarted round waits for the earlier
    rounds' servers (`wait_for_earlier_rounds`); the first call of each round notes this GPU's
    available memory. Returns seconds waited (0 outside torchrun and on later calls)."""
    path, rnd = record_path(), _round()
    if path is None or _STATE["round"] == rnd:
        return 0.0
    waited = wait_for_earlier_rounds(path, rnd, WAIT_S if timeout_s is None else timeout_s)
    _STATE["round"], _STATE["available"] = rnd, available_bytes()
    return waited


def add(pid: int, gpus: list[int], name: str) -> None:
    """Record a started server (its guard's pid, which leads its session)."""
    path = record_path()
    if path is None:
        return
    avail = _STATE.get("available") if _STATE["round"] == _round() else None
    entry = {"round": _round(), "launcher": os.getpid(), "pid": pid,
             "start": _start_time(pid), "gpus": list(gpus), "name": name,
             "device": avail[0] if avail else None, "available": avail[1] if avail else None}
    with _locked(path) as entries:
        entries.append(entry)


def forget(pid: int) -> None:
    """Drop a stopped server from the record once its session is empty (a session still
    exiting stays recorded, for the next round to wait on)."""
    path = record_path()
    if path is None or session_members(pid) or _running(pid, None):
        return
    with _locked(path) as entries:
        entries[:] = [e for e in entries if e.get("pid") != pid]
