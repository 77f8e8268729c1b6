"""Runs that cannot train end with one line and exit code 2, in both rollout modes: every
reward raises, every group has equal rewards (dropped), the learning rate blows the weights
up. None may hang, exit 0 or end in a traceback."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
FAST = ["train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "algorithm.mini_batches=1", "logging.progress_bar=false", "logging.tensorboard=false",
        "train.eval_interval=0", "logging.log_samples=0", "train.max_steps=3"]
REWARDS = """
def boom(text, label, meta):
    raise ValueError("this reward always raises")


def const(text, label, meta):
    return 0.5
"""


TIMEOUT = int(os.environ.get("TRAIN_NOTHING_TIMEOUT", "240"))  # a hang fails after this


def _train(tmp_path, *extra, timeout=TIMEOUT):
    (tmp_path / "rw.py").write_text(REWARDS)
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir",
           str(tmp_path / "run"), *FAST, *extra]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run hung (no end within {timeout} s): {extra}")
    lines = [ln for ln in out.stderr.splitlines()  # events.log lines are "[HH:MM:SS] ..."
             if ln.strip() and not re.match(r"\[\d\d:\d\d:\d\d\] ", ln)]
    return out.returncode, lines, out.stderr


_SLOW = pytest.mark.slow  # each mode and each cause once in the default tier, all four slow


@pytest.mark.parametrize("mode,reward,needle", [
    ("sync", "boom", "this reward always raises"),
    ("async", "const", "had equal rewards"),
    pytest.param("async", "boom", "this reward always raises", marks=_SLOW),
    pytest.param("sync", "const", "had equal rewards", marks=_SLOW),
])
def test_every_group_dropped_stops_with_one_line(tmp_path, mode, reward, needle):
    rc, lines, err = _train(tmp_path, f"rollout.mode={mode}",
                            f"reward.name={tmp_path / 'rw.py'}:{reward}",
                            "rollout.drop_zero_variance_groups=true")
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("megatron-gspo: RolloutError: step 0: ") and needle in lines[0]


def test_weights_blown_up_by_the_learning_rate_is_one_line(tmp_path):
    rc, lines, err = _train(tmp_path, "optimizer.lr=1e30", "optimizer.min_lr=0")
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert "weight version 1" in lines[0] and "optimizer" in lines[0], lines[0]
    assert "non-finite" in lines[0] or "not finite" in lines[0], lines[0]


@pytest.mark.slow
def test_async_checkpoint_resumed_in_sync_mode_is_refused(tmp_path):
    """The groups an asynchronous checkpoint holds (finished untrained, in flight) would be
    skipped by a synchronous resume: the switch is refused with one line."""
    import shutil

    (tmp_path / "rw.py").write_text(REWARDS)
    rc, lines, err = _train(tmp_path, "rollout.mode=async", "train.max_steps=2",
                            "checkpoint.interval=1")
    assert rc == 0, err[-3000:]
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000002")
    rc, lines, err = _train(tmp_path, "rollout.mode=sync", "train.max_steps=2",
                            "checkpoint.interval=1")
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert "config error: rollout.mode: 'sync', but checkpoint" in lines[0] and \
        "resume with rollout.mode=async" in lines[0], lines[0]
