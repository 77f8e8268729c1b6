"""Run a command that the kernel ends when the process that launched it dies.

`python -m megatron_gspo.run.exec_with_parent PARENT_PID -- ARGV...` asks Linux for
`PR_SET_PDEATHSIG` (SIGKILL), checks that the launcher is still alive, then replaces itself
with ARGV: the setting survives `exec`, so the command keeps this pid, session and process
group. Launched rollout servers and routers go through it, so a trainer killed with SIGKILL
(or one whose cleanup never ran) leaves no server holding its ports and GPU memory; SGLang's
own scheduler and detokenizer processes already end with their server.

The kernel tracks the launching *thread*: servers are launched from the rollout engine's
event-loop thread (or the main thread), which lives as long as the engine. Elsewhere than
Linux the command simply runs. Only the standard library is imported here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Run in a child process: the kernel sends `sig` to it when its parent dies.

    Linux only (elsewhere a no-op). When the parent is already gone the child exits now.

    Args:
        parent_pid: pid of the process that started this child.
        sig: signal delivered on the parent's death.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def wrap(argv: list[str]) -> list[str]:
    """`argv` run through this module on behalf of the calling process."""
    return [sys.executable, "-m", "megatron_gspo.run.exec_with_parent", str(os.getpid()), "--",
            *argv]


def main(args: list[str]) -> None:
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        sys.exit("usage: python -m megatron_gspo.run.exec_with_parent PARENT_PID -- ARGV...")
    die_with_parent(int(args[0]))
    try:
        os.execvp(args[2], args[2:])
    except OSError as e:
        sys.exit(f"cannot run {args[2]!r}: {e.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
