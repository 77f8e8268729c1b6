"""checkpoint.async_save (issue 45): the learner's files are written by Megatron-Core's forked
async writers while training goes on. Every checkpoint that says COMPLETE verifies, and a run
resumed from asynchronous checkpoints gives the metrics of a synchronous run, bit for bit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.runtime.run_checkpoint import Checkpointer, verify

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
SETTINGS = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
            "algorithm.mini_batches=2", "logging.progress_bar=false", "logging.tensorboard=false",
            "train.eval_interval=0", "logging.log_samples=0", "checkpoint.interval=1",
            "checkpoint.keep_last=3", "train.max_steps=3"]
TIMING = ("time", "time/", "tokens_per_s", "time_fwd_bwd", "time_optimizer")


def _train(run: Path, *extra: str) -> dict[int, dict]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir", str(run),
           *SETTINGS, *extra]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows}


@pytest.mark.slow
def test_async_checkpoints_are_complete_and_resume_like_sync_ones(tmp_path):
    sync = _train(tmp_path / "sync")
    run = tmp_path / "async"
    _train(run, "checkpoint.async_save=true", "train.max_steps=2")  # stops at step 2 ...
    resumed = _train(run, "checkpoint.async_save=true")  # ... and resumes from it
    assert resumed == sync
    done = Checkpointer(run / "checkpoints").complete()
    assert [s for s, _ in done] == [1, 2, 3]
    assert all(verify(p) is None for _, p in done)
    assert not list((run / "checkpoints").glob(".tmp_*"))
    assert "(asynchronous; " in (run / "events.log").read_text()
