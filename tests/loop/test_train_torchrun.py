"""The demo under `torchrun --nproc_per_node=2` with `parallel.tensor=2` gives the same first-step
loss as one process (1e-5)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
COMMON = ["train.max_steps=1", "train.prompts_per_step=4", "rollout.group_size=4",
          "rollout.max_new_tokens=6", "algorithm.mini_batches=2", "logging.progress_bar=false",
          "logging.tensorboard=false", "train.eval_interval=0", "logging.log_samples=0",
          "checkpoint.interval=0", "precision.old_logprobs=recompute"]


def _first_step(run_dir, launcher, extra=()):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [*launcher, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir",
           str(run_dir), *COMMON, *extra]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[0]


def test_tensor_parallel_2_matches_one_process(tmp_path):
    one = _first_step(tmp_path / "tp1", [sys.executable])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]
    two = _first_step(tmp_path / "tp2", torchrun, ["parallel.tensor=2"])
    assert one["reward/mean"] == two["reward/mean"]  # same rollouts
    assert abs(one["loss"]) > 1e-4  # a non-trivial loss (uncentred mini-batches)
    assert abs(one["loss"] - two["loss"]) <= 1e-5 * max(1.0, abs(one["loss"]))
    for k in ("clip_fraction", "trainable_tokens", "sequences"):
        assert abs(one[k] - two[k]) <= 1e-6, k
    assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-4 * max(1.0, one["grad_norm"])
