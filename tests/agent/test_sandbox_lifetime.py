"""No process of a python tool call outlives the trainer (kill -9, SIGTERM, Ctrl-C in the
middle of the call); its temp dir and cgroup are removed by the trainer (Ctrl-C) or by the
next sandbox made on the machine (after SIGKILL/SIGTERM, when no cleanup of the trainer runs)."""

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from megatron_gspo.agent.tools import sandbox_os

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "multiturn_agent" / "config_cpu.yaml"
SETTINGS = ["agent.environment=tests/agent/sleepy_python_env.py:SleepyPythonEnv",
            "agent.python_tool=true", "train.max_steps=1", "train.prompts_per_step=1",
            "rollout.group_size=2", "train.eval_interval=0", "logging.tensorboard=false",
            ]


def start_trainer(run_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir",
         str(run_dir), *SETTINGS], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)


def wait_for_tool_call(p: subprocess.Popen, timeout: float = 600) -> list[psutil.Process]:
    """The trainer's descendants once a sandboxed program of it is running."""
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        try:
            kids = psutil.Process(p.pid).children(recursive=True)
            if any("def _boot" in " ".join(k.cmdline()) for k in kids):
                time.sleep(0.5)  # well inside the call
                return psutil.Process(p.pid).children(recursive=True)
        except psutil.Error:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no python tool call started (exit {p.poll()}): "
                         f"{p.stderr.read()[-2000:] if p.poll() is not None else ''}")


def leftovers(procs: list[psutil.Process], timeout: float = 10) -> list[str]:
    deadline = time.time() + timeout
    while True:
        alive = [f"{q.pid} {' '.join(q.cmdline())[:60]}" for q in procs if _alive(q)]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def _alive(q: psutil.Process) -> bool:
    try:
        return q.is_running() and q.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_traces(pid: int) -> list[str]:
    tag = sandbox_os.owner_tag(pid)
    return (glob.glob(os.path.join(tempfile.gettempdir(), f"{tag}*"))
            + glob.glob(os.path.join(sandbox_os.PIDS_ROOT, f"{tag}*")))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_tool_call_dies_with_the_trainer(tmp_path, sig):
    p = start_trainer(tmp_path / "run")
    try:
        procs = wait_for_tool_call(p)
        kinds = {Path(q.cmdline()[0]).name for q in procs if _alive(q)}
        assert {"unshare", "sh"} <= kinds, kinds
        assert run_traces(p.pid), "no temp dir or cgroup of the call"
        os.kill(p.pid, sig)
        p.communicate(timeout=120)  # (reading stderr: a full pipe would block the trainer)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    left = leftovers(procs)
    assert not left, f"after {sig.name}: {left}"
    traces = run_traces(p.pid)
    if sig == signal.SIGINT:  # the trainer's own cleanup ran
        assert not traces, traces
    sandbox_os.sweep_stale()  # what the next sandbox made on this machine does first
    assert not run_traces(p.pid)
    print(f"{sig.name}: {len(procs)} processes of the call gone; {len(traces)} temp dirs/"
          "cgroups left by the trainer, removed by the next sweep")


_PARENT = (
    "import asyncio, sys\n"
    "from megatron_gspo.agent.tools.python_sandbox import PythonSandbox\n"
    "sb = PythonSandbox(wall_timeout_s=300)\n"
    "sb.isolate_network = sys.argv[1] == '1'\n"
    "asyncio.run(sb.run('import time\\ntime.sleep(300)'))\n"
)


@pytest.mark.parametrize("isolate", [True, False])
def test_tool_call_dies_with_a_killed_parent(isolate):
    """The same for a bare process running one call (no trainer), with and without the PID
    namespace."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", _PARENT, "1" if isolate else "0"], env=env)
    try:
        procs = wait_for_tool_call(p, timeout=120)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not leftovers(procs), leftovers(procs)
    assert run_traces(p.pid)
    sandbox_os.sweep_stale()
    assert not run_traces(p.pid)


def test_sweep_removes_only_what_dead_owners_left(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = sandbox_os.owner_tag(dead.pid) + "x"
    other_ns = f"{sandbox_os.PREFIX}{dead.pid}.1-x"  # same pid, another PID namespace: kept
    mine = sandbox_os.make_temp_dir()
    os.mkdir(os.path.join(tempfile.gettempdir(), stale))
    os.mkdir(os.path.join(tempfile.gettempdir(), other_ns))
    cg = None
    if os.access(sandbox_os.PIDS_ROOT, os.W_OK):  # a stale cgroup with a process still in it
        cg = os.path.join(sandbox_os.PIDS_ROOT, sandbox_os.owner_tag(dead.pid) + "0")
        os.mkdir(cg)
        sleeper = subprocess.Popen(
            ["/bin/sh", "-c", f'echo $$ > "{cg}/cgroup.procs"; exec sleep 300'])
        time.sleep(0.3)
    try:
        sandbox_os.sweep_stale()
        assert not os.path.exists(os.path.join(tempfile.gettempdir(), stale))
        assert os.path.isdir(mine)  # this process is alive: its dir stays
        assert os.path.isdir(os.path.join(tempfile.gettempdir(), other_ns))
        if cg is not None:
            assert sleeper.wait(timeout=10) == -signal.SIGKILL
            assert not os.path.exists(cg)
    finally:
        os.rmdir(mine)
        os.rmdir(os.path.join(tempfile.gettempdir(), other_ns))


def test_ctrl_c_during_a_tool_call_prints_one_line():
    """Ctrl-C while python tool calls run (issue 43 item 18): the calls are cancelled and
    cleaned up on the engine's loop before it closes, so the trainer says "interrupted" and
    nothing else (no "Task was destroyed", "Event loop is closed", tracebacks)."""
    with tempfile.TemporaryDirectory() as d:
        p = start_trainer(Path(d) / "run")
        try:
            wait_for_tool_call(p)
            os.kill(p.pid, signal.SIGINT)
            _, err = p.communicate(timeout=120)  # read while waiting: a full pipe blocks
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    noise = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[")]
    assert p.returncode == 130, err[-3000:]
    assert noise == ["megatron-gspo: interrupted"], "\n".join(noise[:20])


def test_a_killed_call_is_reaped_by_asyncio_alone(monkeypatch, caplog):
    """The stopped call's child is reaped by asyncio's child watcher only. A second reaper (the
    poll inside Popen.send_signal, bpo-38630) that comes first makes the watcher log "Unknown
    child process pid N, will report returncode 255" (seen on Ctrl-C in CI). It comes first
    when the child is dead and the watcher's thread has not reached its blocking waitpid yet,
    as on a busy machine; here both are made so on purpose."""
    import asyncio
    import logging

    from megatron_gspo.agent.tools.python_sandbox import PythonSandbox

    real_waitpid = os.waitpid

    def late_blocking_waitpid(pid: int, options: int):
        if options == 0:  # the watcher thread's call (a poll passes WNOHANG)
            time.sleep(2.0)
        return real_waitpid(pid, options)

    real_killpg = os.killpg

    def killpg_then_pause(pgid: int, sig: int) -> None:  # the child dies before the next line
        real_killpg(pgid, sig)
        time.sleep(0.3)

    monkeypatch.setattr(os, "waitpid", late_blocking_waitpid)
    monkeypatch.setattr(os, "killpg", killpg_then_pause)
    sb = PythonSandbox(cpu_seconds=5, wall_timeout_s=0.5)

    async def cancelled() -> None:  # Ctrl-C's path: the call's task is cancelled
        task = asyncio.ensure_future(sb.run("import time; time.sleep(30)"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        rc, _, _, timed_out = asyncio.run(sb.run("import time; time.sleep(30)"))
        assert timed_out and rc is None  # the wall-clock kill's path
        asyncio.run(cancelled())
    assert [r.getMessage() for r in caplog.records] == []
