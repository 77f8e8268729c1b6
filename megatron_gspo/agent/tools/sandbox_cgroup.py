"""Cgroups of one python-tool call (issue 54, defect 3): `memory_mb` and `cpu_seconds` bound the
call as a whole, not each of its processes.

`make()` builds, for one call, a cgroup that every process of the call joins before anything
runs (`sandbox_boot.LAUNCH` writes its pid to each `cgroup.procs`):
- cgroup v1: one directory per hierarchy, made under this process's own cgroup there (so a
  limit the trainer's container has still applies): `memory` (memory.limit_in_bytes, and
  memory.memsw.limit_in_bytes where swap is accounted), `cpuacct` (cpuacct.usage) and `pids`
  (pids.max);
- cgroup v2: one directory under this process's own cgroup when that cgroup delegates the
  `memory` and `pids` controllers to its children (its cgroup.subtree_control names them, or
  accepts them: a cgroup with no process of its own, e.g. one that systemd's `Delegate=yes` or
  a container runtime made for the trainer): memory.max, memory.swap.max = 0, pids.max, and
  cpu.stat's usage_usec.
The memory limit is the sum over the call's processes of what they hold (anonymous memory,
page cache they fault, and the files of the work dir, a tmpfs); the caller polls `cpu_s()` and
kills the cgroup when the call's CPU seconds pass the limit. Where neither can be made, `make`
returns None and the call runs as one process (the seccomp filter refuses fork), so its
RLIMIT_AS and RLIMIT_CPU bound the call.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import time

__all__ = ["PREFIX", "CallCgroup", "available", "kill_cgroup", "make", "owner_tag", "parents"]

V1 = "/sys/fs/cgroup"
PREFIX = "gspo-sandbox-"
_IDS = itertools.count()


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag(pid: int | None = None) -> str:
    """Start of the names of the temp dirs and cgroups made by process `pid` (default: this
    one): its pid and PID namespace, so a sweep never takes another namespace's pids for dead."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}.{_pid_ns()}-"


def _own_paths() -> dict[str, str]:
    """controller (v1) or '' (v2) -> this process's cgroup path in that hierarchy."""
    out = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                for c in ctrls.split(",") if ctrls else [""]:
                    out[c] = path
    except (OSError, ValueError):
        pass
    return out


def _v2_mount() -> str | None:
    for m in (V1, os.path.join(V1, "unified")):
        if os.path.exists(os.path.join(m, "cgroup.controllers")):
            return m
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@functools.lru_cache(maxsize=1)
def parents() -> dict[str, str]:
    """Where this process makes call cgroups: {'memory', 'cpuacct', 'pids'} -> v1 directory, or
    {'v2'} -> the delegating v2 directory; {} when no memory and CPU accounting can be had."""
    own = _own_paths()
    v1 = {c: os.path.normpath(os.path.join(V1, c) + own.get(c, "/"))
          for c in ("memory", "cpuacct", "pids")}
    if all(os.access(d, os.W_OK) and os.path.isdir(d) for d in v1.values()):
        return v1
    mount = _v2_mount()
    if mount is None or "" not in own:
        return {}
    d = os.path.normpath(mount + own[""])
    try:
        with open(os.path.join(d, "cgroup.subtree_control")) as f:
            ctl = set(f.read().split())
        if not {"memory", "pids"} <= ctl:
            _write(os.path.join(d, "cgroup.subtree_control"), "+memory +pids")
    except OSError:
        return {}  # not delegated (a cgroup with processes of its own cannot enable them)
    return {"v2": d}


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether a call's cgroup can be made on this host (probed once per process)."""
    cg = make(8, 64 << 20)
    if cg is None:
        return False
    cg.remove()
    return True


class CallCgroup:
    """The cgroup directories of one call."""

    def __init__(self, dirs: dict[str, str]):
        self.dirs = dirs

    @property
    def procs(self) -> list[str]:
        """The cgroup.procs files a process of the call joins."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def cpu_s(self) -> float:
        """CPU seconds the call's processes used so far."""
        try:
            if "v2" in self.dirs:
                with open(os.path.join(self.dirs["v2"], "cpu.stat")) as f:
                    usec = next(int(v) for k, v in (line.split() for line in f)
                                if k == "usage_usec")
                return usec / 1e6
            with open(os.path.join(self.dirs["cpuacct"], "cpuacct.usage")) as f:
                return int(f.read()) / 1e9
        except (OSError, ValueError, StopIteration):
            return 0.0

    def kill(self) -> None:
        """SIGKILL every process of the call (the directories stay)."""
        for d in self.dirs.values():
            kill_cgroup(d, remove=False)

    def remove(self) -> None:
        """SIGKILL every process of the call, then remove the directories."""
        for d in self.dirs.values():
            kill_cgroup(d)


def make(max_processes: int, memory_bytes: int) -> CallCgroup | None:
    """A fresh cgroup for one call: at most `max_processes` processes holding `memory_bytes`
    together; None when none can be made here."""
    where = parents()
    if not where:
        return None
    name = f"{owner_tag()}{next(_IDS)}"
    made: dict[str, str] = {}
    try:
        for key, parent in where.items():
            made[key] = path = os.path.join(parent, name)
            os.mkdir(path)
        if "v2" in made:
            d = made["v2"]
            _write(os.path.join(d, "memory.max"), str(memory_bytes))
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "pids.max"), str(max_processes))
        else:
            _write(os.path.join(made["memory"], "memory.limit_in_bytes"), str(memory_bytes))
            memsw = os.path.join(made["memory"], "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):
                _write(memsw, str(memory_bytes))
            _write(os.path.join(made["pids"], "pids.max"), str(max_processes))
        return CallCgroup(made)
    except OSError:
        CallCgroup(made).remove()
        return None


def kill_cgroup(path: str, remove: bool = True) -> None:
    """SIGKILL every process in the cgroup until it is empty, then remove it (`remove`)."""
    for _ in range(200):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(x) for x in f.read().split()]
        except OSError:
            return
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    for _ in range(100 if remove else 0):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
