"""What the host offers the Python sandbox (probed once per process) and its cleanup.

- `isolation_prefix()`: the `unshare` command giving the child its own namespaces;
  `new_root(prefix)`: whether the first stage builds a root of its own under it.
- `landlock_abi()`: the kernel's Landlock ABI version (0: none), which confines reads.
- `death_prefix()`: a launcher that arms PR_SET_PDEATHSIG (SIGKILL) before the command runs,
  so the first process of every run, and with it the PID namespace, dies with the trainer.
- `readable_files()`: shared libraries the interpreter's extension modules load (and the
  loader's cache), the only files outside the standard library a sandboxed program may read.
- `sweep_stale()`: removes the temp dirs and cgroups (`sandbox_cgroup`) of runs whose trainer
  is gone (after a SIGKILL nothing of the trainer's runs cleanup), killing any
  process still in such a cgroup; called once per process when a sandbox is made.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile

import megatron_gspo.agent.tools.sandbox_cgroup as sandbox_cgroup
from megatron_gspo.agent.tools.sandbox_cgroup import PREFIX, _pid_ns, owner_tag

PIDS_ROOT = "/sys/fs/cgroup/pids"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)\.(\d+)-")


@functools.lru_cache(maxsize=1)
def isolation_prefix() -> tuple[str, ...]:
    """Command prefix giving the child its own PID, mount (fresh /proc) and network namespaces
    (and a user namespace unless the trainer is real root: then the first stage builds the
    sandbox's root and drops to uid nobody itself), strongest first; () if the host allows
    none."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    root_ns = (exe, "--pid", "--fork", "--kill-child", "--mount-proc", "--net")
    for prefix in (
        *((root_ns,) if os.geteuid() == 0 else ()),
        (exe, "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount-proc",
         "--net"),
        root_ns,
        (exe, "--net", "--map-root-user"),
        (exe, "--net"),
    ):
        try:
            r = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return prefix
    return ()


def new_root(prefix: tuple[str, ...]) -> bool:
    """Whether the sandbox gets a root of its own and uid nobody: the trainer is real root and
    `prefix` gives fresh mount and PID namespaces without a user namespace."""
    return (os.geteuid() == 0 and "--mount-proc" in prefix and "--pid" in prefix
            and "--user" not in prefix)


@functools.lru_cache(maxsize=1)
def landlock_abi() -> int:
    """Landlock ABI version of the running kernel; 0 when it has none (or it is disabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, VERSION)
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)


@functools.lru_cache(maxsize=1)
def death_prefix() -> tuple[str, ...]:
    """Launcher that arms PR_SET_PDEATHSIG=SIGKILL (kept across exec) for the command."""
    exe = shutil.which("setpriv")
    if exe is not None:
        try:
            r = subprocess.run([exe, "--pdeathsig", "KILL", "true"], capture_output=True,
                               timeout=10, check=False)
            if r.returncode == 0:
                return (exe, "--pdeathsig", "KILL")
        except (OSError, subprocess.TimeoutExpired):
            pass
    from megatron_gspo.agent.tools.sandbox_boot import PDEATHSIG_PY

    return (sys.executable, "-I", "-S", "-c", PDEATHSIG_PY)


def _needed(path: str) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object ([] if not one)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    if data[:6] != b"\x7fELF\x02\x01":
        return []
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dyn = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:  # PT_DYNAMIC
            dyn = (p_offset, p_filesz)
    if dyn is None:
        return []
    entries = [struct.unpack_from("<qQ", data, dyn[0] + k) for k in range(0, dyn[1], 16)]
    strtab = next((v for t, v in entries if t == 5), None)  # DT_STRTAB (an address)
    if strtab is None:
        return []
    base = next((off + strtab - va for va, off, size in loads if va <= strtab < va + size), None)
    if base is None:
        return []
    out = []
    for tag, val in entries:
        if tag == 1:  # DT_NEEDED
            end = data.index(b"\0", base + val)
            out.append(data[base + val:end].decode(errors="replace"))
    return out


_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
             "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib",
             "/usr/local/lib")


_DLOPENED = ("libgcc_s.so.1",)


@functools.lru_cache(maxsize=1)
def readable_files() -> tuple[str, ...]:
    """Shared libraries the interpreter and the standard library's extension modules load
    (their DT_NEEDED closure, looked up in the interpreter's and the system's library
    directories) and the dynamic loader's cache: the only files outside the standard library a
    sandboxed program may read."""
    dirs = [sysconfig.get_config_var("LIBDIR") or "", *_LIB_DIRS]
    dynload = os.path.join(sysconfig.get_paths()["stdlib"], "lib-dynload")
    # the interpreter itself too: its first stage execs a fresh one (libpython if shared)
    todo = [*sorted(glob.glob(os.path.join(dynload, "*.so"))), os.path.realpath(sys.executable)]
    seen, found = set(), {"/etc/ld.so.cache"}
    # the C library loads libgcc_s at run time (pthread_exit, e.g. a daemon thread at exit)
    extra = list(_DLOPENED)
    while todo or extra:
        for name in extra or _needed(todo.pop()):
            if name in seen:
                continue
            seen.add(name)
            lib = next((os.path.join(d, name) for d in dirs
                        if d and os.path.isfile(os.path.join(d, name))), None)
            if lib is not None:
                found.add(lib)
                todo.append(lib)
        extra = []
    out = set()
    for p in found:
        if os.path.isfile(p):
            out.add(p)
            out.add(os.path.realpath(p))
    return tuple(sorted(out))


@functools.lru_cache(maxsize=1)
def hidden_dirs() -> tuple[str, ...]:
    """Installed-package directories inside the interpreter's standard library (pyenv layouts:
    lib/python3.X/site-packages), which the sandbox's mount namespace covers with an empty
    tmpfs (Landlock already refuses reads of their files; this hides their names too)."""
    out = []
    for key in ("stdlib", "platstdlib"):
        for name in ("site-packages", "dist-packages"):
            p = os.path.realpath(os.path.join(sysconfig.get_paths()[key], name))
            if os.path.isdir(p) and ":" not in p and p not in out:
                out.append(p)
    return tuple(out)


def make_temp_dir() -> str:
    """A fresh temp dir named after this process (so a later sweep knows its owner)."""
    return tempfile.mkdtemp(prefix=owner_tag())


def _owner_gone(name: str) -> bool:
    m = _NAME.match(name)
    if m is None or int(m.group(2)) != _pid_ns():
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def sweep_stale() -> int:
    """Remove sandbox cgroups (killing what is left in them) and temp dirs whose owning
    process no longer exists. Returns how many were removed."""
    n = 0
    roots = dict.fromkeys([PIDS_ROOT, *sandbox_cgroup.parents().values()], True)
    for root, is_cg in (*roots.items(), (tempfile.gettempdir(), False)):
        try:
            names = [e for e in os.listdir(root) if e.startswith(PREFIX)]
        except OSError:
            continue
        for name in names:
            if not _owner_gone(name):
                continue
            path = os.path.join(root, name)
            if is_cg:
                sandbox_cgroup.kill_cgroup(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
            n += not os.path.exists(path)
    return n


_swept: dict[str, bool] = {"done": False}


def sweep_once() -> None:
    """`sweep_stale()` the first time it is called in this process."""
    if not _swept["done"]:
        _swept["done"] = True
        sweep_stale()
