"""Ranks 1..N wait for rank 0's rollout and evaluation on a gloo group with
`parallel.rank0_wait_timeout`, not in a collective of the default group, whose timeout
(`parallel.timeout`, NCCL's watchdog on a GPU) would end the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"


def test_timeouts_are_config_fields_with_long_defaults():
    p = load_config(None, []).parallel
    assert p.timeout >= 1800 and p.rank0_wait_timeout >= 24 * 3600


@pytest.mark.slow
def test_rank0_phase_longer_than_the_collective_timeout_does_not_end_the_run(tmp_path):
    run = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]
    cmd = [*torchrun, str(Path(__file__).with_name("_slow_rank0_worker.py")), "train",
           str(CONFIG), "--run-dir", str(run), "train.max_steps=1", "train.prompts_per_step=2",
           "rollout.group_size=2", "rollout.max_new_tokens=2", "algorithm.mini_batches=1",
           "logging.progress_bar=false", "logging.tensorboard=false", "train.eval_interval=1",
           "train.eval_prompts=2", "logging.log_samples=0", "checkpoint.interval=1",
           "parallel.timeout=10"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", SLOW_RANK0_S="15")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [0]
    # rank 0's rollout and its evaluation (before the checkpoint) each outlasted the 10 s
    assert train[0]["time/rollout"] >= 15 and train[0]["time/step"] >= 30
