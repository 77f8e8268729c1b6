"""The shipped tiny demo learns: a shortened `megatron-gspo train examples/tiny/config.yaml`
(the shipped base model and config, fewer steps) raises the sampled reward."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def test_tiny_demo_reward_rises(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", "examples/tiny/config.yaml",
           "--run-dir", str(run_dir), f"train.max_steps={STEPS}", "train.eval_interval=0",
           "checkpoint.interval=0", "logging.progress_bar=false", "logging.tensorboard=false",
           "logging.log_samples=0"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    reward = [r["reward/mean"] for r in rows]
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    # measured on the 2-core CI machine: 0.46 -> 0.65 (the full 60-step demo reaches ~0.8)
    assert last > first + 0.1, (first, last, reward)
    assert all(r["update_skipped"] == 0 for r in rows)
