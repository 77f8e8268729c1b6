"""`train.deterministic`: torch's and Megatron-Core's determinism switches, and two runs of
the demo with it give identical metrics (every metric but the timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.loop import build

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"


def test_switches(monkeypatch):
    for var in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(var, raising=False)
    assert build.deterministic_switches(False) == {}
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        assert build.deterministic_switches(True) == {"deterministic_mode": True}
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert os.environ["NCCL_ALGO"] == "Ring"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


def _metrics(run: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir", str(run),
           "train.max_steps=2", "train.prompts_per_step=4", "rollout.group_size=4",
           "rollout.max_new_tokens=6", "algorithm.mini_batches=2", "train.deterministic=true",
           "logging.progress_bar=false", "logging.tensorboard=false", "train.eval_interval=0",
           "logging.log_samples=0", "checkpoint.interval=0"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    timing = ("time", "time/", "time_", "tokens_per_s")  # wall clock, durations, rates
    return [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rows]


@pytest.mark.slow
def test_two_deterministic_runs_give_identical_metrics(tmp_path):
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert len(a) == 2 and "loss" in a[0] and "grad_norm" in a[0]
    differ = [(r["step"], k) for r, q in zip(a, b, strict=True) for k in r if r[k] != q.get(k)]
    assert differ == [] and a == b
