"""Sandboxed Python tool (off by default): runs model-written code in a child process.

Layers, strongest first; each applies where the host allows it (probed once per process):
- the first stage (`sandbox_stage`, run as real root in fresh mount/PID/network namespaces):
  a root of its own (`sandbox_mounts`: a tmpfs with read-only binds of exactly the standard
  library, the interpreter, ld.so and the libraries it loads, /dev/null, /dev/zero,
  /dev/urandom, /dev/random, and the work dir: a tmpfs of `max_disk_mb` at the temp dir's path),
  pivot_root and the old root detached (`os.stat` of a host path finds nothing); then uid/gid
  65534 (nobody) outside, no supplementary group, no capability, a user namespace of its own;
  then Landlock and seccomp, and one exec of the model's interpreter, which never loads ctypes.
  Without real root the user namespace of `unshare` and its read-only mounts stand in (the
  host's tree stays visible, reads are still refused by Landlock).
- Landlock (Linux >= 5.13): the kernel refuses every file access outside the temp dir except
  reads of the interpreter's standard library (`_ctypes` and installed packages excluded) and of
  the shared libraries it loads, every exec but the first stage's, TCP bind/connect, and
  signals to processes outside the sandbox. It checks the file actually reached, so no path
  trick, rename race or directory fd gets around it. Required: a kernel without it makes
  `PythonSandbox()` raise `SandboxUnavailable` (one line), unless `require_landlock=False`
  accepts the audit hook as the only guard of reads.
- seccomp-BPF (`sandbox_seccomp`, installed by the first stage after Landlock): the kernel
  refuses every socket (pathname and abstract unix sockets of the host included), every exec
  (memfd too; only the first stage's one exec carries the filter's key), ptrace and other
  processes' memory, namespaces, mounts, io_uring, BPF, keyrings. The audit hook below is a
  convenience layer; the kernel's layers are the wall.
- OS namespaces via `unshare` (`isolation_prefix`): own PID namespace (a shell is init; when it
  dies the kernel kills every process in it, `setsid`/double-forked ones included), own mount
  namespace (the new root above, or, in a user namespace, a fresh /proc with every mount
  remounted read-only and the temp dir a size-limited tmpfs), own network namespace (no
  interfaces). Falls back to fewer namespaces, then to none; without a mount namespace the
  quota is a checked budget (the temp dir's size is polled and the run killed when it passes
  the quota).
- the run dies with the trainer: its first process has PR_SET_PDEATHSIG (SIGKILL), and the PID
  namespace's init dies with it (`unshare --kill-child`), so kill -9, SIGTERM or Ctrl-C of the
  trainer leaves no process of the run. Temp dirs and cgroups of runs whose trainer was killed
  are removed when the next sandbox is made (`sandbox_os.sweep_stale`).
- a cgroup per call (`sandbox_cgroup`, v1 or v2, where one can be made): `memory_mb` (plus
  the work dir's `max_disk_mb`, a tmpfs: memory too) and `cpu_seconds` bound all the call's
  processes together (the CPU seconds are polled and the call killed past them), pids.max caps
  their number (fork bombs), and the parent SIGKILLs every member at the end, whatever its
  session. Where no cgroup can be made the call is one process (seccomp refuses fork), so its
  rlimits bound the call as a whole (issue 54, defect 3: per-process limits let one call hold
  16 x `memory_mb`).
- resource limits set in the child before the code runs: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE,
  RLIMIT_CORE = 0, RLIMIT_NPROC (not enforced by the kernel for a real-root user, hence the
  cgroup), RLIMIT_NOFILE.
- the start: a fresh temporary directory as cwd and HOME, a minimal environment (nothing of the
  trainer's), `python -I -S`, the program on stdin, its own session; after the wall-clock limit
  (and after every run) the session, the namespace and the cgroup are killed; stdout/stderr are
  read with a size cap.
- a Python audit hook installed before the user code is compiled into a fresh `__main__`: its
  policy is frozensets/tuples and C functions captured in a closure (nothing in module globals);
  it denies paths outside the temp dir (reads of the interpreter's standard library allowed, but
  no directory fds there), paths that are not plain str/bytes, process creation, ctypes,
  sockets, limits, gc introspection and frame access (`tb_frame`, `gi_frame`, ...), so user code
  can neither reach the hook's closure nor run its own code inside the hook. Only code the
  compiler made in the sandbox runs: marshal (`loads`, `load`: also importlib's, zipimport's and
  `_imp`'s frozen loader with data), the code type's constructor and `replace`, functions from
  code objects and `__code__` assignment are refused, and imports compile their source (the
  cached bytecode is never read; the most used modules are loaded from the interpreter's own
  read-only bytecode before the hook, so they cost nothing), so no crafted bytecode (issue 54,
  defect 1) can be built.
On this project's CPU host (root, unprivileged user namespaces allowed, cgroup v1 memory,
cpuacct and pids writable, Landlock ABI 7) all layers apply.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import sys
from typing import Any, ClassVar

import megatron_gspo.agent.tools.sandbox_cgroup as sandbox_cgroup
import megatron_gspo.agent.tools.sandbox_mounts as sandbox_mounts
import megatron_gspo.agent.tools.sandbox_os as sandbox_os
import megatron_gspo.agent.tools.sandbox_seccomp as sandbox_seccomp
from megatron_gspo.agent.tools.toolset import ToolError, truncate_output
from megatron_gspo.agent.tools.sandbox_boot import BOOTSTRAP, INIT, LAUNCH
from megatron_gspo.agent.tools.sandbox_os import PIDS_ROOT as _PIDS_ROOT, isolation_prefix
from megatron_gspo.agent.tools.sandbox_stage import INIT_NEW_ROOT, STAGE
from megatron_gspo.config.tool_limits import check_python_limits

__all__ = ["PythonSandbox", "SandboxUnavailable", "_PIDS_ROOT", "isolation_prefix"]

_QUOTA_MARK = "sandbox: killed: the working directory passed its quota"


class SandboxUnavailable(RuntimeError):
    """The host cannot confine the sandbox as required."""


class PythonSandbox:
    """The `python` tool: `{"code": "..."}` -> stdout (and stderr) of the run.

    Args:
        cpu_seconds: CPU seconds of the call, all its processes together (a cgroup; without
            one the call is one process and this is its RLIMIT_CPU).
        memory_mb: memory of the call, all its processes together (a cgroup whose limit is
            memory_mb + max_disk_mb, the work dir being a tmpfs; without one the call is one
            process), and the RLIMIT_AS of each process.
        wall_timeout_s: wall-clock limit; the process group is killed after it.
        max_output_chars: cap on the returned text.
        max_file_mb: largest file the code may write inside its temp dir.
        max_disk_mb: byte quota of the temp dir per call (all files together); a call that
            writes past it fails with a message naming the quota, other calls are unaffected.
        isolate_network: run in new user/PID/mount/network namespaces when available (sockets
            are refused by Landlock and the audit hook either way).
        max_processes: RLIMIT_NPROC and pids-cgroup cap on the child's processes (1 where no
            cgroup can be made).
        require_landlock: refuse to run (SandboxUnavailable) on a kernel without Landlock;
            False runs there with the audit hook as the only guard of reads (not recommended).
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
        max_disk_mb: int = 64,
        isolate_network: bool = True,
        max_code_chars: int = 20000,
        max_processes: int = 16,
        require_landlock: bool = True,
    ):
        # typed and bounded (a limit the kernel cannot take would fail every call)
        check_python_limits(dict(
            cpu_seconds=cpu_seconds, memory_mb=memory_mb, wall_timeout_s=wall_timeout_s,
            max_output_chars=max_output_chars, max_file_mb=max_file_mb, max_disk_mb=max_disk_mb,
            isolate_network=isolate_network, max_code_chars=max_code_chars,
            max_processes=max_processes, require_landlock=require_landlock), "python_kwargs")
        self.landlock = sandbox_os.landlock_abi() > 0
        if require_landlock and not self.landlock:
            raise SandboxUnavailable(
                "python tool: this kernel has no Landlock (Linux >= 5.13 with landlock among "
                "its LSMs, and a container that allows the landlock syscalls), so the sandbox "
                "cannot keep reads inside its temp dir; refusing to run it (python_kwargs "
                "require_landlock: false accepts the audit hook alone)")
        self.cpu_seconds = int(cpu_seconds)
        self.memory_bytes = int(memory_mb) * 1024 * 1024
        self.wall_timeout_s = float(wall_timeout_s)
        self.max_output_chars = int(max_output_chars)
        self.max_file_bytes = int(max_file_mb) * 1024 * 1024
        self.max_disk_bytes = int(max_disk_mb) * 1024 * 1024
        self.isolate_network = isolate_network
        self.max_code_chars = max_code_chars
        self.max_processes = int(max_processes)
        try:  # a call in a cgroup may fork; one without is one process (its rlimits bound it)
            self._seccomp = {bounded: sandbox_seccomp.filter_program(processes=bounded).hex()
                             for bounded in (True, False)}
        except ValueError as e:
            raise SandboxUnavailable(f"python tool: {e}") from None
        sandbox_os.sweep_once()

    def _command(self, tmp: str, cgroup: sandbox_cgroup.CallCgroup | None
                 ) -> tuple[list[str], bool]:
        """(argv of the run, whether the PID/mount namespace with its init shell is used)."""
        prefix = isolation_prefix() if self.isolate_network else ()
        # in a PID namespace a shell is init (so the program's death by signal reads as 128+N);
        # as real root the first stage builds the root (the work dir's tmpfs included), else
        # the init shell makes every mount read-only and the temp dir a tmpfs
        ns = "--pid" in prefix and "--mount-proc" in prefix
        own_root = sandbox_os.new_root(prefix)
        if own_root:
            init: tuple[str, ...] = ("/bin/sh", "-c", INIT_NEW_ROOT, "sh")
        elif ns:
            init = ("/bin/sh", "-c", INIT, "sh", tmp, str(self.max_disk_bytes),
                    ":".join(sandbox_os.hidden_dirs()))
        else:
            init = ()
        conf = sandbox_mounts.stage_conf(tmp, self.max_disk_bytes, landlock=self.landlock,
                                         new_root=own_root)
        final = [sandbox_mounts.python_exe(), "-I", "-S", "-c", BOOTSTRAP, tmp,
                 str(self.cpu_seconds), str(self.memory_bytes), str(self.max_file_bytes),
                 str(self.max_processes), "1" if self._audit_hook else "0"]
        stage = [sys.executable, "-I", "-S", "-c", STAGE, conf,
                 self._seccomp[cgroup is not None], "--", *final]
        procs = ":".join(cgroup.procs) if cgroup is not None else ""
        launch = ["/bin/sh", "-c", LAUNCH, "sh", str(os.getpid()), procs]
        return [*sandbox_os.death_prefix(), *launch, *prefix, *init, *stage], ns

    async def run(self, code: str) -> tuple[int | None, str, str, bool]:
        """Run `code`; returns (exit code or None if killed, stdout, stderr, timed_out)."""
        tmp = sandbox_os.make_temp_dir()
        # the call as a whole: memory (the work dir's tmpfs files included) and CPU seconds
        cgroup = sandbox_cgroup.make(self.max_processes + 4,
                                     self.memory_bytes + self.max_disk_bytes)
        try:
            cmd, ns = self._command(tmp, cgroup)
            env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                cwd=tmp,
                env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            cap = self.max_output_chars * 4 + 1024
            over: list[int] = []  # set by the budget check when the temp dir passed the quota
            tasks = [_feed(proc.stdin, code.encode("utf-8", "surrogatepass")),
                     _read_capped(proc.stdout, cap), _read_capped(proc.stderr, cap)]
            watch = None if ns else asyncio.ensure_future(
                _watch_disk(tmp, self.max_disk_bytes, proc.pid, over))
            cpu_over: list[float] = []
            cpu_watch = None if cgroup is None else asyncio.ensure_future(
                _watch_cpu(cgroup, self.cpu_seconds, cpu_over))
            timed_out = False
            try:
                _, out, err = await asyncio.wait_for(_gather(tasks),
                                                     timeout=self.wall_timeout_s)
                rc = await asyncio.wait_for(proc.wait(), timeout=self.wall_timeout_s)
            except asyncio.TimeoutError:
                timed_out, out, err, rc = True, b"", b"", None
            finally:
                for w in (watch, cpu_watch):
                    if w is not None:
                        w.cancel()
                # Everything started from the child dies: its process group/session, the PID
                # namespace (killing its init kills all), and every member of the cgroup.
                # The child leads its own group, so killpg reaches it; no proc.kill() after it:
                # Popen.send_signal polls first (bpo-38630), and a poll that wins the race
                # against asyncio's child watcher reaps the child under it, which then logs
                # "Unknown child process pid N, will report returncode 255" (CPython's
                # asyncio/unix_events.py, ThreadedChildWatcher._do_waitpid). Only the watcher
                # reaps, so the pid stays ours (alive or a zombie) until proc.wait() returns.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass  # no member left (or none this process may signal): nothing to kill
                if proc.returncode is None:
                    await proc.wait()
                if cgroup is not None:
                    cgroup.remove()
                    cgroup = None
            if ns and rc is not None and rc > 128:
                rc = 128 - rc
            if rc is not None and rc < 0:
                rc = None if rc == -signal.SIGKILL else rc
            err_text = err.decode(errors="replace")
            if not ns and not over and (used := _disk_usage(tmp)) > self.max_disk_bytes:
                over.append(used)  # passed the quota between two checks
            if over:
                rc, timed_out = None, False
                err_text += f"\n{_QUOTA_MARK} ({over[0]} bytes)\n"
            elif cpu_over:
                rc, timed_out = None, False
                err_text += (f"\nsandbox: killed: the call's processes used {cpu_over[0]:.1f} "
                             f"CPU seconds together (limit {self.cpu_seconds})\n")
            return rc, out.decode(errors="replace"), err_text, timed_out
        finally:
            if cgroup is not None:
                cgroup.remove()
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
        quota = f"{self.max_disk_bytes / 2 ** 20:g} MiB"
        if _QUOTA_MARK in err or f"[Errno {errno.ENOSPC}]" in err:
            raise ToolError(f"the program wrote more than the {quota} its working directory "
                            "may hold (all files together)")
        text = out
        if rc != 0:
            reason = "killed (CPU or memory limit)" if rc is None or rc < 0 else f"exit code {rc}"
            tail = err.strip().splitlines()[-3:]
            text += f"\n[{reason}]" + ("\n" + "\n".join(tail) if tail else "")
        return truncate_output(text.strip() or "(no output)", self.max_output_chars)[0]


async def _gather(coros: list) -> list:
    # in a task of its own: when the call is cancelled (Ctrl-C), the gather's CancelledError
    # is retrieved here instead of being logged as "exception was never retrieved"
    return await asyncio.gather(*coros)


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    """Write the program to the child's stdin and close it (the child may be gone)."""
    try:
        stream.write(data)
        await stream.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        stream.close()


def _disk_usage(root: str) -> int:
    total, todo = 0, [root]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            total += max(st.st_size, st.st_blocks * 512)
            if e.is_dir(follow_symlinks=False):
                todo.append(e.path)
    return total


async def _watch_disk(root: str, limit: int, pgid: int, over: list[int]) -> None:
    """The checked budget where there is no tmpfs: poll the temp dir's size; past `limit`,
    kill the run's process group and record the size."""
    while True:
        await asyncio.sleep(0.05)
        used = await asyncio.to_thread(_disk_usage, root)
        if used > limit:
            over.append(used)
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return


async def _watch_cpu(cgroup: sandbox_cgroup.CallCgroup, limit: float, over: list[float]) -> None:
    """Poll the call's CPU seconds (all its processes); past `limit`, kill them all."""
    while True:
        await asyncio.sleep(0.05)
        used = cgroup.cpu_s()
        if used > limit:
            over.append(used)
            await asyncio.to_thread(cgroup.kill)
            return


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    """Read a stream to EOF, keeping at most `cap` bytes (the rest is drained)."""
    buf = bytearray()
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(buf)
        if len(buf) < cap:
            buf += chunk[: cap - len(buf)]
