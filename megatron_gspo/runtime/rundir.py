"""One writer per run directory, and no silent overwrite of an earlier run.

- `RunDirLock`: `RUN_DIR/run.lock` holds the writer's pid and host (JSON) under an exclusive
  POSIX record lock (`fcntl.lockf`). The kernel drops it when its process ends, however it ends
  (kill -9 too), and, unlike `flock`, processes forked by the writer (checkpoint writers, the
  multiprocessing manager) do not share it, so a child that outlives a killed trainer for a
  moment cannot keep the run dir locked. A lock file whose lock is free is stale and is taken
  over (`takeover_note` says whose it was). A held lock is refused with one line naming the
  holder's pid and host. Nothing else in the writer may open and close `run.lock` (closing any
  descriptor of the file drops a POSIX lock). On file systems without lock support the pid
  decides: a holder on this host whose pid is gone is stale, a holder on another host is
  refused (its liveness cannot be checked from here). Given the checkpoint dir too, the same
  lock is taken on `CKPT_DIR/checkpoints.lock` (it names the holder's run dir): two runs with
  different run dirs but one `checkpoint.dir` would resume from and rotate away each other's
  checkpoints.
- `check_start`: `train.resume: never` into a run dir that already holds checkpoints or
  metrics (`check_fresh_start`), or `auto` into one with metrics but no complete checkpoint,
  is an error naming the dir (a fresh run would overwrite them).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

__all__ = ["RunError", "RunDirLock", "check_fresh_start", "check_start"]

LOCK_NAME = "run.lock"
CKPT_LOCK_NAME = "checkpoints.lock"  # in the checkpoint dir (`checkpoint.dir`)


class RunError(RuntimeError):
    """A run that cannot start or continue safely (one-line message)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirLock:
    """Exclusive writer lock of a run directory (taken by the writing rank only).

    POSIX record locks never conflict inside one process, so locks held by this process are
    also kept in `_HELD` (a second acquire in the same process is refused, and never closes
    the first one's descriptor, which would drop its lock).

    Args:
        run_dir: the run directory (created if missing).
    """

    _HELD: dict[str, int] = {}

    def __init__(self, run_dir: str | os.PathLike, ckpt_root: str | os.PathLike | None = None,
                 *, _name: str = LOCK_NAME, _what: str = "run dir"):
        self.path = Path(run_dir) / _name
        self.what = _what
        self.takeover_note = ""
        self._fd: int | None = None
        self._run_dir = str(run_dir)
        # the checkpoint dir is locked too (`CKPT_LOCK_NAME`, same mechanism): two runs sharing
        # it would resume from and rotate away each other's checkpoints
        self._ckpt = None if ckpt_root is None else RunDirLock(
            ckpt_root, _name=CKPT_LOCK_NAME, _what="checkpoint dir")
        if self._ckpt is not None:
            self._ckpt._run_dir = str(run_dir)

    def _read(self, fd: int) -> dict:
        try:
            raw = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            held = json.loads(raw) if raw.strip() else {}
            return held if isinstance(held, dict) else {}
        except (OSError, ValueError):
            return {}

    def _refuse(self, held: dict) -> RunError:
        who = f"pid {held.get('pid', '?')} on host {held.get('host', '?')}"
        if self.what == "run dir":
            return RunError(f"run dir {self.path.parent} is in use by {who} (lock {self.path}); "
                            "wait for it to end or use another --run-dir")
        return RunError(f"checkpoint dir {self.path.parent} is in use by {who}, the run in "
                        f"{held.get('run_dir', '?')} (lock {self.path}); two runs must not share "
                        "checkpoint.dir: wait for it to end or set another checkpoint.dir")

    def acquire(self) -> "RunDirLock":
        """Take the lock (and the checkpoint dir's) or raise RunError naming the holder."""
        self._acquire()
        if self._ckpt is not None:
            try:
                self._ckpt._acquire()
            except BaseException:
                self.release()
                raise
            if self._ckpt.takeover_note:
                self.takeover_note = "; ".join(n for n in (self.takeover_note,
                                                           self._ckpt.takeover_note) if n)
        return self

    def _acquire(self) -> "RunDirLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.path)
        if key in RunDirLock._HELD:
            raise self._refuse({"pid": os.getpid(), "host": socket.gethostname()})
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
              "run_dir": os.path.abspath(self._run_dir)}
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            flock_ok = True
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    held = self._read(fd)
                    os.close(fd)
                    raise self._refuse(held) from None
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                flock_ok = False
            try:  # the file may have been released (unlinked) between open and flock
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            held = self._read(fd)
            if held and not flock_ok:
                local = held.get("host") == me["host"]
                if not local or (held.get("pid") != me["pid"] and _pid_alive(int(held["pid"]))):
                    os.close(fd)
                    raise self._refuse(held)
            if held.get("pid") is not None:
                self.takeover_note = (f"took over the stale lock {self.path} of pid "
                                      f"{held.get('pid')} on host {held.get('host')} "
                                      "(that process has ended)")
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
            self._fd = fd
            RunDirLock._HELD[key] = fd
            return self
        raise RunError(f"could not take the lock {self.path} (it keeps being replaced)")

    def release(self) -> None:
        """Remove the lock files and drop the locks (idempotent)."""
        if self._ckpt is not None:
            self._ckpt.release()
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # before closing: a waiter then sees a new file, not ours
        except FileNotFoundError:
            pass
        RunDirLock._HELD.pop(os.path.realpath(self.path), None)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _metrics_rows(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and any(ln.strip() for ln in metrics.read_text(
        errors="replace").splitlines())


def _wrote_checkpoints(run_dir: Path) -> bool:
    """The run in `run_dir` saved a checkpoint (its events.log says so), or nobody can tell
    (no events.log)."""
    events = run_dir / "events.log"
    if not events.is_file():
        return True
    return any("] checkpoint " in ln for ln in events.read_text(errors="replace").splitlines())


def check_start(run_dir: str | os.PathLike, ckpt_root: str | os.PathLike, resume: str) -> None:
    """Raise RunError when starting would overwrite an earlier run: `train.resume: never` into
    a run dir that holds one (`check_fresh_start`), or `auto` into a run dir whose metrics
    have no checkpoint to continue from although the run saved some (an unmounted or emptied
    `checkpoint.dir`): starting from the initial weights would empty metrics.jsonl. A run that
    ended before its first checkpoint (events.log names none) starts over from the initial
    weights, as a resume redoes the steps after its checkpoint."""
    if resume == "never":
        check_fresh_start(run_dir, ckpt_root)
        return
    run_dir, root = Path(run_dir), Path(ckpt_root)
    steps = [p for p in root.glob("step_*") if (p / "COMPLETE").is_file()] \
        if root.is_dir() else []
    if not steps and _metrics_rows(run_dir) and _wrote_checkpoints(run_dir):
        raise RunError(f"run dir {run_dir} holds metrics ({run_dir / 'metrics.jsonl'}) but "
                       f"checkpoint dir {root} holds no complete checkpoint (unmounted or "
                       "emptied?); train.resume=auto would start from the initial weights and "
                       "overwrite the metrics: restore the checkpoints or point checkpoint.dir "
                       "at them, or use a new --run-dir (or remove metrics.jsonl) to start over")


def check_fresh_start(run_dir: str | os.PathLike, ckpt_root: str | os.PathLike) -> None:
    """Raise RunError when `run_dir` already holds a run (`train.resume: never`).

    A run is there when the checkpoint root has any `step_*` folder or `metrics.jsonl` has a
    record: starting over would overwrite those checkpoints, let rotation delete the new ones
    and empty the metrics.
    """
    run_dir, root = Path(run_dir), Path(ckpt_root)
    steps = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
    metrics = run_dir / "metrics.jsonl"
    if steps or _metrics_rows(run_dir):
        what = f"checkpoints ({steps[-1]} in {root})" if steps else f"metrics ({metrics})"
        raise RunError(f"run dir {run_dir} already holds a run's {what} and train.resume is "
                       "'never'; use a new --run-dir, delete the old run, or train.resume=auto "
                       "to continue it")
