"""No process started by a training run outlives it: after a normal exit and after kill -9 of
the trainer (during the run, after a checkpoint was written), nothing that inherited the run's
environment is still alive.

Every process of the run carries a unique marker in its environment; the check scans
/proc/*/environ for it, which also finds children re-parented to init."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
FAST = ["train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "algorithm.mini_batches=1", "logging.progress_bar=false", "logging.tensorboard=false",
        "train.eval_interval=0", "logging.log_samples=0", "checkpoint.interval=1"]

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


def _marked(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment holds `tag`."""
    needle = f"MEGATRON_GSPO_LEAK_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
            if needle not in env.split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":  # a zombie is already dead (its parent has not reaped it yet)
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        found.append((int(entry.name), cmd[:160]))
    return found


def _wait_gone(tag: str, timeout: float = 15.0) -> list[tuple[int, str]]:
    deadline = time.time() + timeout
    left = _marked(tag)
    while left and time.time() < deadline:
        time.sleep(0.2)
        left = _marked(tag)
    return left


def _start(model, run_dir, tag, *extra):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2",
               MEGATRON_GSPO_LEAK_TAG=tag)
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir",
           str(run_dir), f"model.path={model}", *FAST, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _kill_leftovers(left):
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_no_child_outlives_a_normal_exit(random_tiny_model, tmp_path):
    tag = uuid.uuid4().hex
    proc = _start(random_tiny_model, tmp_path / "run", tag, "train.max_steps=2")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "COMPLETE").exists()
    left = _wait_gone(tag)
    _kill_leftovers(left)
    assert left == [], f"processes outlived the run: {left}"


def test_no_child_outlives_kill_9_of_the_trainer(random_tiny_model, tmp_path):
    tag = uuid.uuid4().hex
    proc = _start(random_tiny_model, tmp_path / "run", tag, "train.max_steps=50")
    marker = tmp_path / "run" / "checkpoints" / "step_00000001" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.stderr.read()[-3000:] if proc.poll() is not None else "timeout"
    children = [p for p in _marked(tag) if p[0] != proc.pid]
    assert children, "the run started no child process: the test would prove nothing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    left = _wait_gone(tag)
    _kill_leftovers(left)
    assert left == [], f"processes outlived the killed trainer: {left}"


@pytest.mark.slow
def test_checkpoint_queue_server_dies_with_os_exit(tmp_path):
    """The torch_dist results-queue server ends with a process that leaves through os._exit
    (as multi-process test workers do), where atexit finalizers never run."""
    tag = uuid.uuid4().hex
    code = ("import os\n"
            "from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa\n"
            "from megatron_gspo.megatron.io.child_procs import install_checkpoint_results_queue\n"
            "assert install_checkpoint_results_queue()\n"
            "q = fsa._get_write_results_queue()\n"
            "q.put(1); assert q.get() == 1\n"
            "print('ok', flush=True)\n"
            "os._exit(0)\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore", MEGATRON_GSPO_LEAK_TAG=tag)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    left = _wait_gone(tag)
    _kill_leftovers(left)
    assert left == [], f"processes outlived os._exit: {left}"


def test_processes_forked_by_the_trainer_die_with_it():
    """Megatron's torch_dist writer forks workers that report through a JoinableQueue; a worker
    whose trainer was killed while waiting in join() blocks for ever in task_done(). After
    `tie_forked_children()` a forked child is killed with its parent (kill -9 included)."""
    tag = uuid.uuid4().hex
    code = ("import multiprocessing as mp, time\n"
            "from megatron_gspo.megatron.io.child_procs import tie_forked_children\n"
            "tie_forked_children()\n"
            "q = mp.get_context('fork').JoinableQueue()\n"
            "def work(q):\n"
            "    q.get(); time.sleep(3); q.task_done()\n"
            "p = mp.get_context('fork').Process(target=work, args=(q,)); p.start()\n"
            "q.put(1); print(p.pid, flush=True); q.join()\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore", MEGATRON_GSPO_LEAK_TAG=tag)
    trainer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, text=True)
    child = int(trainer.stdout.readline())
    try:
        time.sleep(0.5)  # the trainer waits in join(), the worker is inside its work
        assert any(pid == child for pid, _ in _marked(tag))
        trainer.kill()
        trainer.wait()
        left = _wait_gone(tag, timeout=10.0)
        assert not left, f"outlived the killed trainer: {left}"
    finally:
        trainer.kill()
        for pid, _ in _marked(tag):
            os.kill(pid, signal.SIGKILL)
