"""Run a command that ends, with everything it started, when the process that launched it dies.

`python -m megatron_gspo.runtime.exec_with_parent PARENT_PID -- ARGV...` asks Linux for
`PR_SET_PDEATHSIG` on the launcher's death, checks that the launcher is still alive, then runs
ARGV as its child and stays beside it as a guard:

- the launcher dies (SIGKILL included, or a worker that torchrun's agent took down): the guard
  kills the command and, when the guard leads its own session (launched servers are started
  with `start_new_session=True`), every process left in that session;
- the command exits: the guard kills what it left in that session, then exits the same way (the
  command's exit code, or the signal that ended it).

Why not the command's own `PR_SET_PDEATHSIG`: that only covers the one process. SGLang's
scheduler and detokenizer processes arm their own (`kill_itself_when_parent_died()` in
sglang/srt/managers/scheduler.py and detokenizer_manager.py), but only after a spawn and their
imports; a server killed in that window (a rank killed while its server starts) leaves them
running for good, reparented to init and holding the server's ports and memory. The guard arms
before the command exists, so there is no such window, and it sweeps the whole session.

Signals to the group (ServerProcess.stop's SIGTERM, a terminal's Ctrl-C) reach the command
directly; the guard ignores them and waits. A guard that does not lead its group (a study's
arm) forwards SIGTERM to the command. The kernel tracks the launching *thread*: servers are
launched from the rollout engine's event-loop thread (or the main thread), which lives as long
as the engine. Elsewhere than Linux the command simply runs. Only the standard library is
imported here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: the signal the guard gets when its launcher dies (never sent to it otherwise)
GUARD_SIGNAL = signal.SIGUSR1


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
    return [sys.executable, "-m", "megatron_gspo.runtime.exec_with_parent", str(os.getpid()), "--",
            *argv]


def session_members(sid: int) -> list[int]:
    """Pids of the processes in session `sid`, this process left out (Linux /proc)."""
    me, found = os.getpid(), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":
            found.append(int(name))
    return found


def kill_session_but_me(sid: int, passes: int = 3) -> None:
    """SIGKILL every other process in session `sid` (a few passes: a dying member may fork)."""
    for _ in range(passes):
        members = session_members(sid)
        if not members:
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def guard(parent_pid: int, argv: list[str]) -> int:
    """Run `argv` as a child under the guard described above; returns its exit status as a
    shell reports it (128+N for a signal N, after the guard re-raised N on itself)."""
    leads_session = os.getsid(0) == os.getpid()
    leads_group = os.getpgrp() == os.getpid()
    child: dict[str, subprocess.Popen] = {}

    def launcher_died(signum, frame) -> None:
        if leads_session:
            kill_session_but_me(os.getpid())
        elif "p" in child:
            try:
                child["p"].kill()
            except ProcessLookupError:
                pass
        os._exit(128 + signal.SIGKILL)

    def forward_or_ignore(signum, frame) -> None:
        if signum == signal.SIGTERM and not leads_group and "p" in child \
                and child["p"].returncode is None:
            child["p"].send_signal(signum)

    # handlers (not SIG_IGN) so the command, after exec, starts with the default dispositions
    signal.signal(GUARD_SIGNAL, launcher_died)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward_or_ignore)
    die_with_parent(parent_pid, GUARD_SIGNAL)
    # the launcher's death waits while the child starts (so the handler knows the child); the
    # child itself starts with the signal unblocked
    only_guard = {GUARD_SIGNAL}
    signal.pthread_sigmask(signal.SIG_BLOCK, only_guard)
    try:
        child["p"] = subprocess.Popen(
            argv, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, only_guard))
    except OSError as e:
        sys.exit(f"cannot run {argv[0]!r}: {e.strerror}")
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, only_guard)
    rc = child["p"].wait()
    if leads_session:
        kill_session_but_me(os.getpid())
    if rc < 0:  # ended by a signal: end the same way, so the launcher sees what the command did
        if -rc in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, GUARD_SIGNAL):
            signal.signal(-rc, signal.SIG_DFL)  # (SIGKILL's handler cannot be set, nor reset)
        os.kill(os.getpid(), -rc)
        return 128 - rc
    return rc


def main(args: list[str]) -> None:
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        sys.exit("usage: python -m megatron_gspo.runtime.exec_with_parent PARENT_PID -- ARGV...")
    if not sys.platform.startswith("linux"):
        os.execvp(args[2], args[2:])
    sys.exit(guard(int(args[0]), args[2:]))


if __name__ == "__main__":
    main(sys.argv[1:])
