"""Sandboxed Python tool (off by default): runs model-written code in a child process.

Layers, all applied to every run:
- a fresh temporary directory as cwd and HOME, a clean environment, `python -I -S`
  (no site-packages, no user paths, no PYTHON* variables);
- resource limits set in the child before the code runs: RLIMIT_CPU (seconds), RLIMIT_AS
  (address space), RLIMIT_FSIZE (largest file written), RLIMIT_CORE = 0;
- a wall-clock timeout after which the whole process group is killed;
- no network: the child runs in a new network namespace (`unshare --net`) when the host allows
  it, and in every case an audit hook refuses sockets;
- a Python audit hook installed before the code runs (hooks cannot be removed) that denies
  opening or listing paths outside the temp dir (reads of the interpreter's own standard library
  are allowed so imports work), process creation (subprocess, fork, exec, os.system), ctypes,
  changing limits, links, and sockets;
- stdout/stderr capped in size.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any, ClassVar

from megatron_gspo.agent.tools.base import ToolError, truncate_output

# Runs in the child as `python -I -S -c BOOTSTRAP <tmpdir> <cpu_s> <mem_bytes> <fsize_bytes>`.
_BOOTSTRAP = r"""
import sys, os, resource
_tmp = os.path.realpath(sys.argv[1])
_cpu, _mem, _fsize = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu))
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
_ro = tuple(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))
_src = open(os.path.join(_tmp, "main.py")).read()
_realpath, _sep, _fspath = os.path.realpath, os.sep, os.fspath
_DENY_PREFIX = ("subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "ctypes.", "socket.",
                "resource.", "sys.setrecursionlimit")
_DENY = {"os.system", "os.fork", "os.forkpty", "os.link", "os.symlink", "os.chmod", "os.chown",
         "os.chdir", "os.chroot", "os.kill", "os.killpg", "pty.spawn", "sys.addaudithook",
         "os.putenv", "os.unsetenv", "mmap.__new__", "syslog.openlog", "fcntl.ioctl",
         "sys.settrace", "sys.setprofile", "os.startfile"}
_NOIMPORT = {"ctypes", "_ctypes", "socket", "_socket", "subprocess", "_posixsubprocess",
             "multiprocessing", "_multiprocessing", "mmap", "pty", "fcntl", "_ssl", "ssl",
             "signal", "_signal"}

def _inside(path, roots):
    return any(path == r or path.startswith(r + _sep) for r in roots)

def _resolve(p):
    if isinstance(p, int):
        return None
    p = _fspath(p)
    if isinstance(p, bytes):
        p = p.decode(errors="replace")
    return _realpath(p)

def _hook(event, args):
    if event in _DENY or event.startswith(_DENY_PREFIX):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].split(".")[0] in _NOIMPORT:
        raise ImportError(f"sandbox: import of {args[0]} is not allowed")
    if event == "open":
        path = _resolve(args[0])
        if path is None:
            return
        mode, flags = args[1], args[2]
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
        if _inside(path, (_tmp,)) or (not writing and _inside(path, _ro)):
            return
        raise PermissionError(f"sandbox: access to {args[0]!r} is denied")
    if event in ("os.listdir", "os.scandir", "os.remove", "os.rmdir", "os.rename", "os.mkdir",
                 "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "glob.glob",
                 "os.walk", "shutil.move", "shutil.copytree"):
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)):
                path = _resolve(a)
                ok = _inside(path, (_tmp,)) or (
                    event in ("os.listdir", "os.scandir", "glob.glob") and _inside(path, _ro))
                if not ok:
                    raise PermissionError(f"sandbox: access to {a!r} is denied")

_code = compile(_src, "main.py", "exec")
sys.addaudithook(_hook)
del resource
_g = {"__name__": "__main__", "__builtins__": __builtins__}
exec(_code, _g)
"""


@functools.lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """Command prefix that runs a process without network, or () if the host does not allow it."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    for prefix in ((exe, "--net", "--map-root-user"), (exe, "--net")):
        try:
            r = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return prefix
    return ()


class PythonSandbox:
    """The `python` tool: `{"code": "..."}` -> stdout (and stderr) of the run.

    Args:
        cpu_seconds: RLIMIT_CPU of the child.
        memory_mb: RLIMIT_AS of the child.
        wall_timeout_s: wall-clock limit; the process group is killed after it.
        max_output_chars: cap on the returned text.
        max_file_mb: largest file the code may write inside its temp dir.
        isolate_network: run in a new network namespace when available (sockets are refused
            by the audit hook either way).
    """

    name = "python"
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

    async def run(self, code: str) -> tuple[int | None, str, str, bool]:
        """Run `code`; returns (exit code or None if killed, stdout, stderr, timed_out)."""
        tmp = tempfile.mkdtemp(prefix="gspo-sandbox-")
        try:
            _write_text(os.path.join(tmp, "main.py"), code)
            prefix = network_namespace_prefix() if self.isolate_network else ()
            cmd = [
                *prefix, sys.executable, "-I", "-S", "-c", _BOOTSTRAP, tmp,
                str(self.cpu_seconds), str(self.memory_bytes), str(self.max_file_bytes),
            ]
            env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
            proc = await asyncio.create_subprocess_exec(
                *cmd, cwd=tmp, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
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
                if proc.returncode is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    await proc.wait()
            if rc is not None and rc < 0:
                rc = None if rc == -signal.SIGKILL else rc
            return rc, out.decode(errors="replace"), err.decode(errors="replace"), timed_out
        finally:
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
