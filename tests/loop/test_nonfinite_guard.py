"""Non-finite loss / gradients: the optimizer update is skipped (counted, logged), the weights
stay finite, N skipped steps in a row stop the run with one line, and no checkpoint of
non-finite weights is ever written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.runtime.run_checkpoint import Checkpointer, verify
from megatron_gspo.runtime.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_nan_batch_skips_the_update_and_keeps_weights():
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_nan_worker.py"))],
                         cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                         capture_output=True, text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    r = json.loads(line[0][len("RESULT "):])
    assert r == {"skipped": 2.0, "unchanged": True, "finite": True, "ok_skipped": 0.0,
                 "moved": True, "refused": True}, r


@pytest.mark.slow
def test_nan_steps_in_a_row_stop_the_run_with_one_line(random_tiny_model, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train",
           str(ROOT / "examples" / "tiny" / "config.yaml"), "--run-dir", str(run),
           f"model.path={random_tiny_model}", "train.max_steps=4", "train.prompts_per_step=2",
           "rollout.group_size=2", "rollout.max_new_tokens=2", "algorithm.mini_batches=2",
           "logging.progress_bar=false", "logging.tensorboard=false", "train.eval_interval=0",
           "logging.log_samples=0", "checkpoint.interval=1", "train.max_skipped_steps=2"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               MEGATRON_GSPO_FAULT="nan_loss@1,nan_loss@2")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    err = [ln for ln in out.stderr.splitlines() if ln.startswith("megatron-gspo:")]
    assert out.returncode == 2 and len(err) == 1, out.stderr[-3000:]
    assert "step 2" in err[0] and "max_skipped_steps" in err[0]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["update_skipped"] for r in rows] == [0.0, 2.0, 2.0]
    assert rows[1]["loss"] is None and rows[0]["loss"] is not None
    events = (run / "events.log").read_text()
    assert "step 1: 2 of 2 optimizer updates skipped" in events
    ck = Checkpointer(run / "checkpoints")
    assert [s for s, _ in ck.complete()] == [1, 2]  # step 2's row raised before its save
    assert all(verify(p) is None for _, p in ck.complete())
    assert not (run / "run.lock").exists()
