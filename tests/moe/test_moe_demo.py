"""The MoE demo (examples/moe): shipped base model, config checks of `moe.*`, and 20 training
steps on CPU in each routing-replay mode with the `moe/*` metrics in metrics.jsonl and the plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_gspo.loop import build, early_checks
from megatron_gspo.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "examples" / "moe"
BASE = MOE / "base"


def test_base_model_files_and_accuracy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert sum(p.stat().st_size for p in BASE.iterdir()) < 5 * 2**20
    cfg = json.loads((BASE / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]) == (8, 2, 2)
    from megatron_gspo.megatron.models.builder import build_model_config

    mc = build_model_config(cfg, use_te=False)
    assert (mc.num_moe_experts, mc.moe_router_topk, mc.moe_router_pre_softmax) == (8, 2, True)
    tok = AutoTokenizer.from_pretrained(BASE)
    model = AutoModelForCausalLM.from_pretrained(BASE).eval()
    rows = [json.loads(x) for x in (ROOT / "examples/tiny/data/eval.jsonl").read_text()
            .splitlines()[:128]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                       add_generation_prompt=True, tokenize=False) for r in rows]
    ids = torch.tensor([tok.encode(p, add_special_tokens=False) for p in prompts])  # [B, T]

    def acc(**kw) -> float:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                 pad_token_id=tok.pad_token_id, **kw)
        texts = tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        return sum(t.strip() == r["answer"] for t, r in zip(texts, rows, strict=True)) / len(rows)

    assert acc(do_sample=False) > 0.8
    torch.manual_seed(0)
    assert 0.1 <= acc(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) <= 0.6


def test_moe_config_checks():
    dense = load_config(ROOT / "examples/tiny/config.yaml", ["moe.routing_replay=r2"])
    with pytest.raises(ConfigError, match=r"moe.routing_replay: 'r2' needs an MoE model"):
        early_checks.check_inputs(dense, build.read_hf_config(dense.model.path),
                                  build.tokenizer(dense))
    moe = load_config(MOE / "config.yaml", ["moe.routing_replay=r3"])
    early_checks.check_inputs(moe, build.read_hf_config(moe.model.path), build.tokenizer(moe))
    with pytest.raises(ConfigError, match="moe.engine_routing is false"):
        load_config(MOE / "config.yaml", ["moe.routing_replay=r3", "moe.engine_routing=false"])
    with pytest.raises(ConfigError, match="moe.routing_replay"):
        load_config(MOE / "config.yaml", ["moe.routing_replay=r4"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "r2", "r3"])
def test_moe_demo_trains_20_steps(tmp_path, mode):
    run = tmp_path / mode
    env = dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "train",
                        str(MOE / "config.yaml"), "--run-dir", str(run),
                        f"moe.routing_replay={mode}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    wall = time.time() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(20))
    for r in rows:
        assert r["moe/routers_replayed_share"] == (0.0 if mode == "none" else 1.0)
        assert 0.5 < r["moe/routing_agreement/min"] <= r["moe/routing_agreement/mean"] <= 1.0
        assert 0.0 <= r["moe/expert_change_rate"] < 1.0
        assert (r["moe/tokens_without_routing_record"] == 0) == (mode == "r2")
    assert min(r["moe/routing_agreement/mean"] for r in rows) < 1.0  # bf16 engine, fp32 learner
    plot = subprocess.run([sys.executable, "tools/plot_metrics.py", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert plot.returncode == 0 and (run / "metrics.png").exists(), plot.stderr
    first, last = rows[0]["reward/mean"], sum(r["reward/mean"] for r in rows[-5:]) / 5
    print(f"\nmoe demo {mode}: {wall:.0f} s wall, reward {first:.3f} -> {last:.3f} (last 5 mean)")


@pytest.mark.slow
def test_r2_with_engine_logprobs_and_one_minibatch(tmp_path):
    """r2 when pi_old is the engine's: a recording forward at the step's start weights (unless
    the step was audited, whose learner forward records); with one mini-batch a forward after
    the update measures the expert-change rate."""
    run = tmp_path / "r2-rollout"
    env = dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "train",
                        str(MOE / "config.yaml"), "--run-dir", str(run), "train.max_steps=3",
                        "moe.routing_replay=r2", "precision.old_logprobs=rollout",
                        "algorithm.mini_batches=1", "train.eval_interval=0",
                        "checkpoint.interval=0"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert r.get("moe/recording_forward") == 1.0 or r["precision/audited"] == 1.0
        assert r["moe/routers_replayed_share"] == 1.0
        assert 0.0 <= r["moe/expert_change_rate"] < 1.0
        assert r["moe/tokens_without_routing_record"] == 0
