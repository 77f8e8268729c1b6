"""Sandboxed Python tool (off by default): runs model-written code in a child process.

Layers, strongest first; each applies where the host allows it (probed once per process):
- OS namespaces via `unshare` (`isolation_prefix`): own user namespace (capabilities only there,
  so RLIMIT_NPROC binds a root parent too), own PID namespace (a shell is init; when it dies the
  kernel kills every process in it, `setsid`/double-forked ones included), own mount namespace
  with a fresh /proc (the trainer's processes and /proc/<pid>/environ are not visible) in which
  every mount is remounted read-only except the temp dir (`_INIT`), own network namespace (no
  interfaces). Falls back to fewer namespaces, then to none.
- a pids cgroup (v1, `/sys/fs/cgroup/pids`) per run when writable: caps the number of processes
  (fork bombs) and lets the parent SIGKILL every member at the end, whatever its session.
- resource limits set in the child before the code runs: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE,
  RLIMIT_CORE = 0, RLIMIT_NPROC (not enforced by the kernel for a real-root user, hence the
  cgroup), RLIMIT_NOFILE.
- the start: a fresh temporary directory as cwd and HOME, a minimal environment (nothing of the
  trainer's), `python -I -S`, its own session; after the wall-clock limit (and after every run)
  the session, the namespace and the cgroup are killed; stdout/stderr are read with a size cap.
- a Python audit hook installed before the user code is compiled into a fresh `__main__`: its
  policy is frozensets/tuples and C functions captured in a closure (nothing in module globals);
  it denies paths outside the temp dir (reads of the interpreter's standard library allowed, but
  no directory fds there), paths that are not plain str/bytes, process creation, ctypes,
  sockets, limits, gc introspection and frame access (`tb_frame`, `gi_frame`, ...), so user code
  can neither reach the hook's closure nor run its own code inside the hook.
On this project's CPU host (root, unprivileged user namespaces allowed, cgroup v1 writable) all
layers apply. The child keeps the parent's uid (the interpreter lives in a home directory that
another uid cannot read): the read-only mounts stop writes outside the temp dir (also those the
audit hook does not see, such as os.mkfifo), but reads of world- or owner-readable files are
kept inside the temp dir and the standard library only by the audit hook.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, ClassVar

from megatron_gspo.agent.tools.base import ToolError, truncate_output

# Runs in the child as
# `python -I -S -c BOOTSTRAP <tmpdir> <cpu_s> <mem_bytes> <fsize_bytes> <nproc> <hook 0|1>`.
# Everything lives inside _boot(); the policy is frozensets/tuples captured by the hook's closure,
# and user code runs in a fresh `__main__` module that holds none of it.
_BOOTSTRAP = r"""
def _boot():
    import sys, os, resource, gc
    gc_isenabled, gc_disable, gc_enable = gc.isenabled, gc.disable, gc.enable
    argv = sys.argv
    tmp = os.path.realpath(argv[1])
    cpu, mem, fsize, nproc = (int(a) for a in argv[2:6])
    use_hook = argv[6] == "1"
    for lim, val in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem),
                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_NOFILE, 64)):
        resource.setrlimit(lim, (val, val))
    ro = tuple(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))
    with open(os.path.join(tmp, "main.py")) as f:
        src = f.read()
    code = compile(src, "main.py", "exec")
    sep, lstat, readlink, stat_, getcwd = (
        os.sep, os.lstat, os.readlink, os.stat, os.getcwd)
    deny_prefix = ("subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "ctypes.",
                   "socket.", "resource.", "gc.", "sys._current_frames", "pty.", "winreg.")
    deny = frozenset({
        "os.system", "os.fork", "os.forkpty", "os.link", "os.symlink", "os.chmod", "os.chown",
        "os.chdir", "os.chroot", "os.kill", "os.killpg", "sys.addaudithook", "os.putenv",
        "os.unsetenv", "mmap.__new__", "syslog.openlog", "fcntl.ioctl", "sys.settrace",
        "sys.setprofile", "os.startfile", "sys.setrecursionlimit",
        "function.__new__", "code.__new__",
        "cpython.run_command", "cpython.run_module", "cpython.run_file",
        "os.setuid", "os.setgid", "os.setsid", "os.setpgid", "signal.pthread_kill"})
    noimport = frozenset({
        "ctypes", "_ctypes", "socket", "_socket", "subprocess", "_posixsubprocess",
        "multiprocessing", "_multiprocessing", "mmap", "pty", "fcntl", "_ssl", "ssl", "signal",
        "_signal", "gc", "_posixshmem", "_testcapi", "_testinternalcapi", "resource",
        "_ctypes_test"})
    path_events = frozenset({
        "os.listdir", "os.scandir", "os.remove", "os.rmdir", "os.rename", "os.mkdir",
        "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "glob.glob", "os.walk",
        "shutil.move", "shutil.copytree"})
    list_events = frozenset({"os.listdir", "os.scandir", "glob.glob"})
    tmp_roots = (tmp,)

    def resolve(p):
        # Own resolver (C functions only): module attributes the user can patch are not used.
        # Only plain str/bytes: anything else could run user code inside the hook.
        if type(p) is int:
            return None
        if type(p) is bytes:
            p = p.decode("utf-8", "replace")
        elif type(p) is not str:
            raise PermissionError("sandbox: paths must be str or bytes")
        if not p.startswith(sep):
            p = getcwd() + sep + p
        todo, parts, hops = p.split(sep), [], 0
        while todo:
            c = todo.pop(0)
            if c in ("", "."):
                continue
            if c == "..":
                if parts:
                    parts.pop()
                continue
            cur = sep + sep.join(parts + [c])
            try:
                is_link = (lstat(cur).st_mode & 0o170000) == 0o120000
            except OSError:
                is_link = False
            if is_link:
                hops += 1
                if hops > 40:
                    return cur
                target = readlink(cur)
                if target.startswith(sep):
                    parts = []
                todo = target.split(sep) + todo
                continue
            parts.append(c)
        return sep + sep.join(parts)

    def inside(path, roots):
        return any(path == r or path.startswith(r + sep) for r in roots)

    def is_dir(path):
        try:
            return (stat_(path).st_mode & 0o170000) == 0o040000
        except OSError:
            return False

    def hook(event, args):
        # No garbage collection while checking: a finalizer of the user's could otherwise run
        # inside the hook and walk up to its frame.
        was_enabled = gc_isenabled()
        gc_disable()
        try:
            check(event, args)
        finally:
            if was_enabled:
                gc_enable()

    def check(event, args):
        if event in deny or event.startswith(deny_prefix):
            raise PermissionError(f"sandbox: {event} is not allowed")
        # frames (tracebacks, generators) would lead to the hook's own frame and closure
        if event == "object.__getattr__" and args[1] != "__code__":
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in noimport:
            raise ImportError(f"sandbox: import of {args[0]} is not allowed")
        if event == "open":
            path = resolve(args[0])
            if path is None:
                return
            mode, flags = args[1], args[2]
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and bool(flags & 0o3 or flags & 0o100))
            if inside(path, tmp_roots):
                return
            # no directory fds outside: a dir_fd would let relative paths escape the check
            if not writing and inside(path, ro) and not is_dir(path):
                return
            raise PermissionError(f"sandbox: access to {path!r} is denied")
        if event in path_events:
            for a in args[:2]:
                t = type(a)
                if t is str or t is bytes or not (t is int or t is bool or t is tuple or a is None):
                    path = resolve(a)
                    if not (inside(path, tmp_roots) or (event in list_events and inside(path, ro))):
                        raise PermissionError(f"sandbox: access to {path!r} is denied")

    import types
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    g = main.__dict__
    if use_hook:
        sys.addaudithook(hook)
    return code, g

_c, _g = _boot()
del _boot
exec(_c, _g)
"""


@functools.lru_cache(maxsize=1)
def isolation_prefix() -> tuple[str, ...]:
    """Command prefix giving the child its own user, PID, mount (fresh /proc) and network
    namespaces, strongest first; () if the host allows none."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    for prefix in (
        (
            exe,
            "--user",
            "--map-root-user",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--net",
        ),
        (exe, "--pid", "--fork", "--kill-child", "--mount-proc", "--net"),
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


# Init of the PID namespace: in its own mount namespace, bind the temp dir onto itself, remount
# every mount read-only, the temp dir read-write again, enter the new bind mount; then run the
# program and pass on its status. A mount that cannot be remounted (odd names) stays as it was;
# the audit hook still covers it. Only ever run inside a new mount namespace.
_INIT = r"""
T=$1; shift
if mount --bind "$T" "$T" 2>/dev/null; then
    while read -r _dev m _rest; do
        mount -o remount,bind,ro "$m" 2>/dev/null
    done < /proc/self/mounts
    mount -o remount,bind,rw "$T" 2>/dev/null
fi
cd "$T" || exit 1
"$@"; exit $?
"""

_PIDS_ROOT = "/sys/fs/cgroup/pids"


def _make_pids_cgroup(max_processes: int) -> str | None:
    """A fresh cgroup (v1 pids controller) capped at `max_processes`, or None if not writable."""
    if not os.access(_PIDS_ROOT, os.W_OK):
        return None
    path = None
    try:
        path = os.path.join(_PIDS_ROOT, f"gspo-sandbox-{os.getpid()}-{next(_CG_IDS)}")
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_processes))
        return path
    except OSError:
        if path is not None:
            _remove_cgroup(path)
        return None


def _kill_cgroup(path: str) -> None:
    """SIGKILL every process in the cgroup until it is empty, then remove it."""
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
    _remove_cgroup(path)


def _remove_cgroup(path: str) -> None:
    for _ in range(100):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


_CG_IDS = itertools.count()


class PythonSandbox:
    """The `python` tool: `{"code": "..."}` -> stdout (and stderr) of the run.

    Args:
        cpu_seconds: RLIMIT_CPU of the child.
        memory_mb: RLIMIT_AS of the child.
        wall_timeout_s: wall-clock limit; the process group is killed after it.
        max_output_chars: cap on the returned text.
        max_file_mb: largest file the code may write inside its temp dir.
        isolate_network: run in new user/PID/mount/network namespaces when available (sockets
            are refused by the audit hook either way).
        max_processes: RLIMIT_NPROC and pids-cgroup cap on the child's processes.
    """

    name = "python"
    _audit_hook = True  # the Python audit-hook layer; tests turn it off to test the OS layers
    description = (
        "Run a short Python program (standard library only, no files outside the working "
        "directory, no network) and return what it prints."
    )
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run"}},
        "required": ["code"],
    }

    def __init__(
        self,
        *,
        cpu_seconds: int = 5,
        memory_mb: int = 512,
        wall_timeout_s: float = 10.0,
        max_output_chars: int = 4000,
        max_file_mb: int = 16,
        isolate_network: bool = True,
        max_code_chars: int = 20000,
        max_processes: int = 16,
    ):
        if cpu_seconds <= 0 or memory_mb <= 0 or wall_timeout_s <= 0 or max_output_chars <= 0:
            raise ValueError("PythonSandbox: limits must be positive")
        self.cpu_seconds = int(cpu_seconds)
        self.memory_bytes = int(memory_mb) * 1024 * 1024
        self.wall_timeout_s = float(wall_timeout_s)
        self.max_output_chars = int(max_output_chars)
        self.max_file_bytes = int(max_file_mb) * 1024 * 1024
        self.isolate_network = isolate_network
        self.max_code_chars = max_code_chars
        self.max_processes = int(max_processes)

    async def run(self, code: str) -> tuple[int | None, str, str, bool]:
        """Run `code`; returns (exit code or None if killed, stdout, stderr, timed_out)."""
        tmp = tempfile.mkdtemp(prefix="gspo-sandbox-")
        cgroup = _make_pids_cgroup(self.max_processes + 4)
        try:
            _write_text(os.path.join(tmp, "main.py"), code)
            prefix = isolation_prefix() if self.isolate_network else ()
            # in a PID namespace a shell is init (so the program's death by signal reads as
            # 128+N); in its own mount namespace it first makes every mount read-only but tmp
            ns = "--pid" in prefix and "--mount-proc" in prefix
            init = ("/bin/sh", "-c", _INIT, "sh", tmp) if ns else ()
            cmd = [
                *prefix,
                *init,
                sys.executable,
                "-I",
                "-S",
                "-c",
                _BOOTSTRAP,
                tmp,
                str(self.cpu_seconds),
                str(self.memory_bytes),
                str(self.max_file_bytes),
                str(self.max_processes),
                "1" if self._audit_hook else "0",
            ]
            if cgroup is not None:  # join the cgroup before anything else starts
                procs = os.path.join(cgroup, "cgroup.procs")
                join = f'{{ echo $$ > "{procs}"; }} 2>/dev/null; exec "$@"'
                cmd = ["/bin/sh", "-c", join, "sh", *cmd]
            env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                cwd=tmp,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            cap = self.max_output_chars * 4 + 1024
            reads = asyncio.gather(_read_capped(proc.stdout, cap), _read_capped(proc.stderr, cap))
            timed_out = False
            try:
                out, err = await asyncio.wait_for(reads, timeout=self.wall_timeout_s)
                rc = await asyncio.wait_for(proc.wait(), timeout=self.wall_timeout_s)
            except asyncio.TimeoutError:
                timed_out, out, err, rc = True, b"", b"", None
            finally:
                # Everything started from the child dies: its process group/session, the PID
                # namespace (killing its init kills all), and every member of the cgroup.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                if proc.returncode is None:
                    try:
                        proc.kill()
                    except ProcessLookupError:
                        pass
                    await proc.wait()
                if cgroup is not None:
                    _kill_cgroup(cgroup)
                    cgroup = None
            if init and rc is not None and rc > 128:
                rc = 128 - rc
            if rc is not None and rc < 0:
                rc = None if rc == -signal.SIGKILL else rc
            return rc, out.decode(errors="replace"), err.decode(errors="replace"), timed_out
        finally:
            if cgroup is not None:
                _kill_cgroup(cgroup)
            shutil.rmtree(tmp, ignore_errors=True)

    async def __call__(self, arguments: dict[str, Any]) -> str:
        if set(arguments) != {"code"}:
            raise KeyError('python takes exactly one argument, "code"')
        code = arguments["code"]
        if not isinstance(code, str) or len(code) > self.max_code_chars:
            raise ToolError(f"code must be a string of at most {self.max_code_chars} characters")
        rc, out, err, timed_out = await self.run(code)
        if timed_out:
            raise ToolError(f"program killed after the {self.wall_timeout_s:g} s time limit")
        text = out
        if rc != 0:
            reason = "killed (CPU or memory limit)" if rc is None or rc < 0 else f"exit code {rc}"
            tail = err.strip().splitlines()[-3:]
            text += f"\n[{reason}]" + ("\n" + "\n".join(tail) if tail else "")
        return truncate_output(text.strip() or "(no output)", self.max_output_chars)[0]


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    """Read a stream to EOF, keeping at most `cap` bytes (the rest is drained)."""
    buf = bytearray()
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(buf)
        if len(buf) < cap:
            buf += chunk[: cap - len(buf)]
