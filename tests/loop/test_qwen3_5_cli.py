"""`megatron-gspo train` on the tiny Qwen3.5 dense / MoE models (tests/convert/tiny_qwen3_5.py)
through a launched SGLang stand-in server (`rollout.standin.server`, the embedded engine behind
SGLang's HTTP API): 3 GSPO steps, a weight sync after each verified by the sync probe
(`rollout.verify_sync_interval` 1, the default), the MoE model with r3 routing replay."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.convert.tiny_qwen3_5 import DENSE, MOE, make_qwen3_5

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "tiny" / "base"  # 128 tokens: fits the tiny models' 160
REWARD = "def reward(text, label, meta):\n    return len(set(text)) / 8.0\n"


@pytest.mark.slow
@pytest.mark.parametrize("arch", [DENSE, MOE])
def test_three_steps_with_the_sync_probe(arch, tmp_path):
    model, run = tmp_path / "model", tmp_path / "run"
    make_qwen3_5(model, arch == MOE)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (model / f).write_bytes((TOKENIZER / f).read_bytes())
    (tmp_path / "rw.py").write_text(REWARD)  # rewards that differ inside a group
    over = [f"model.path={model}", f"reward.name={tmp_path / 'rw.py'}:reward",
            "model.dtype=float32", "train.max_steps=3", "train.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.engine=sglang",
            "rollout.num_servers=1", "rollout.startup_timeout=240", "optimizer.lr=1e-3",
            "checkpoint.interval=0", "train.eval_interval=0", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.log_samples=0",
            *(["moe.routing_replay=r3"] if arch == MOE else [])]
    out = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "train",
                          str(ROOT / "examples/tiny/config.yaml"), "--run-dir", str(run), *over],
                         cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2",
                                  SGLANG_SERVER_MODULE="megatron_gspo.rollout.standin.server"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    probes = [r["weight_sync/probe_max_diff"] for r in rows if "weight_sync/probe_max_diff" in r]
    print(f"\n{arch}: " + "; ".join(f"step {r['step']}: loss {r['loss']:.4g} grad "
                                     f"{r['grad_norm']:.4g}" for r in rows) + f"; probes {probes}")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["update_skipped"] == 0 and r["rollout/samples"] == 16
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert len(probes) == 3 and all(p < 1e-4 for p in probes), probes  # fp32: served = learner
    if arch == MOE:
        assert all(r["moe/routers_replayed_share"] == 1.0 for r in rows)
