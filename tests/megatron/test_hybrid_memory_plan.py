"""The memory plan of a gated delta-net hybrid (Qwen3.5-35B-A3B): parameters as transformers
counts them, SGLang 0.5.23's pools (KV of the full-attention layers, a delta-net state per
request slot, the requests those slots serve), the shipped one- and two-node configs through
`megatron-gspo plan` and the device-memory ledger, and dense plans unchanged to the byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_gspo.cli.plan_checks import text_model_config
from megatron_gspo.megatron.memory import hybrid
from megatron_gspo.megatron.memory import plan as mp
from megatron_gspo.megatron.memory import report as mr
from megatron_gspo.runtime.device_ledger import DeviceLedger, LedgerSpec
from megatron_gspo.runtime.sglang_pools import ServerKnobs, gdn_state_bytes, hybrid_pools

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "examples" / "qwen3_gpu"
SHAPE = GPU / "shapes" / "Qwen3.5-35B-A3B"
GB80 = 80 * 10**9


def _hf() -> dict:
    return text_model_config(json.loads((SHAPE / "config.json").read_text()))


def _plan(config: str, nodes: int, overrides=()):
    from megatron_gspo.config import load_config

    cfg = load_config(GPU / config, list(overrides))
    x = mr.inputs_from_config(cfg, _hf(), gpu_bytes=GB80, gpus_per_node=8, nodes=nodes)
    return x, mr.build_plan(x)


def test_the_released_layout_is_read_as_its_text_model():
    raw = json.loads((SHAPE / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert raw["model_type"] == "qwen3_5_moe" and "text_config" in raw
    hf = _hf()
    assert hf["architectures"] == ["Qwen3_5MoeForCausalLM"]
    d = mp.dims_from_hf(hf)
    assert (d.layers, sum(d.linear), d.hidden, d.vocab, d.experts, d.topk) == (
        40, 30, 2048, 248320, 256, 8)
    assert [i for i, lin in enumerate(d.linear) if not lin] == [3, 7, 11, 15, 19, 23, 27, 31,
                                                                 35, 39]
    assert (d.lk_heads, d.lv_heads, d.lk_dim, d.lv_dim, d.conv, d.shared_ffn) == (
        16, 32, 128, 128, 4, 512)
    dense = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8}
    assert text_model_config(dense) is dense


def test_parameters_are_the_ones_transformers_builds():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = _hf()
    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**fields))
    d = mp.dims_from_hf(hf)
    total = mp.learner_bytes(d, param_bytes=4, vocab_multiple=1).weights // 4
    assert total == sum(p.numel() for p in model.parameters()) == 34_660_610_688
    for i in (0, 3):  # a delta-net layer, a full-attention layer
        mine = sum(n for n, _ in hybrid.layer_numels(d, i, tp=1, ep=1, etp=1))
        assert mine == sum(p.numel() for p in model.model.layers[i].parameters())
    # under TP2 / EP8 every split tensor halves, experts spread over EP
    lin = hybrid.layer_numels(d, 0, tp=2, ep=8, etp=1)
    assert lin[1] == ((2 * 2048 + 2 * 4096 + 2 * 32) * 2048 // 2, "tp")  # in_proj
    assert lin[2] == (8192 // 2 * 4, "tp")  # depthwise conv1d, no bias
    assert sum(k.startswith("expert") for _, k in lin) == 2 * 256 // 8


def test_delta_net_state_per_request_is_sglangs_mamba_cache_per_req():
    # per linear layer: conv [(v + 2 qk) / tp, kernel - 1] bf16 + recurrent [nv / tp, 128, 128]
    # fp32 (configs/qwen3_next.py mamba2_cache_params, configs/mamba_utils.py)
    per_layer = (4096 + 2 * 2048) * 3 * 2 + 32 * 128 * 128 * 4
    for tp in (1, 2, 4, 8):
        got = gdn_state_bytes(linear_layers=30, key_heads=16, value_heads=32, key_dim=128,
                              value_dim=128, conv_kernel=4, tp=tp)
        assert got == 30 * per_layer // tp
    assert gdn_state_bytes(linear_layers=30, key_heads=16, value_heads=32, key_dim=128,
                           value_dim=128, conv_kernel=4, tp=4, ssm_dtype="bfloat16") == \
        30 * ((8192 // 4) * 3 * 2 + 8 * 128 * 128 * 2)
    # 16 key heads over TP32: the groups are replicated to follow the heads
    assert gdn_state_bytes(linear_layers=1, key_heads=16, value_heads=32, key_dim=128,
                           value_dim=128, conv_kernel=4, tp=32) == \
        (4096 + 2 * 32 * 128) // 32 * 3 * 2 + 1 * 128 * 128 * 4


def test_hybrid_pools_follow_handle_max_mamba_cache():
    gib, per, cell = 2**30, 16 * 2**20, 10240
    free, weights, f = 70 * gib, 16 * gib, 0.8
    rest = free * f - weights
    p = hybrid_pools(free, weights, f, cell, per, 262144)
    assert p.state_slots == int((rest * 0.9 / 1.9 - per) // per)
    assert p.state_bytes == (p.state_slots + 1) * per  # the pool's padding slot
    assert p.kv_tokens == int(rest - p.state_bytes) // cell
    assert p.max_running_requests == p.state_slots // 5  # 3 + 2 extra-buffer slots
    # the ratio, an explicit pool size, no radix cache with a request cap, no overlap
    assert hybrid_pools(free, weights, f, cell, per, 262144,
                        ServerKnobs(mamba_full_memory_ratio=0.5)).state_slots == \
        int((rest / 3 - per) // per)
    q = hybrid_pools(free, weights, f, cell, per, 262144, ServerKnobs(max_mamba_cache_size=100))
    assert (q.state_slots, q.max_running_requests, q.state_bytes) == (100, 20, 101 * per)
    q = hybrid_pools(free, weights, f, cell, per, 262144,
                     ServerKnobs(disable_radix_cache=True, max_running_requests=64))
    assert (q.state_slots, q.max_running_requests) == (64, 64)
    q = hybrid_pools(free, weights, f, cell, per, 262144, ServerKnobs(max_running_requests=32))
    assert q.max_running_requests == 32
    assert ServerKnobs(disable_overlap_schedule=True).slots_per_request() == 4
    # too little memory: no request fits (SGLang refuses to start)
    q = hybrid_pools(20 * gib, int(15.9 * gib), 0.8, cell, per, 262144)
    assert (q.state_slots, q.max_running_requests) == (2, 0)


def test_server_knobs_are_read_from_extra_server_args():
    k = ServerKnobs.from_argv(["--max-running-requests", "128", "--mamba-full-memory-ratio=0.5",
                               "--disable-radix-cache", "--mamba-ssm-dtype", "bfloat16",
                               "--other", "x"])
    assert (k.max_running_requests, k.mamba_full_memory_ratio, k.disable_radix_cache,
            k.mamba_ssm_dtype) == (128, 0.5, True, "bfloat16")
    with pytest.raises(ValueError, match="extra_server_args"):
        ServerKnobs.from_argv(["--max-running-requests", "many"])


# (config, nodes): the plan's per-GPU peak, and SGLang's pools on each server rank
SHIPPED = {("qwen3_5_35b_a3b_1node.yaml", 1): ("generation", 62.20),
           ("qwen3_5_35b_a3b_2nodes.yaml", 2): ("optimizer step", 63.39)}


@pytest.mark.parametrize("config,nodes", sorted(SHIPPED))
def test_shipped_configs_fit_with_state_that_serves_the_batch(config, nodes):
    x, plan = _plan(config, nodes)
    assert plan.fits, plan.problems
    name, total, _ = max(plan.moments, key=lambda m: m[1])
    assert (name, round(total / mp.GiB, 2)) == SHIPPED[(config, nodes)]
    per = hybrid.state_bytes_per_request(x.dims, x.server_tp, x.knobs)
    assert per == 16_097_280 and x.server_tp == 4
    assert plan.kv_tokens == 2_267_045 and plan.state_slots == 1296
    assert plan.max_running_requests == 259 >= x.batch_per_server == 256
    assert plan.term(hybrid.STATE_ROW) == 1297 * per
    assert plan.term("SGLang KV cache") == plan.kv_tokens * 10240  # 10 full layers, 1 KV head
    gen = next(parts for n, _, parts in plan.moments if n == "generation")
    assert hybrid.STATE_ROW in gen
    text = mr.format_plan(plan, x)
    assert "SGLang delta-net state" in text and "259 requests at once" in text
    assert text.rstrip().endswith("fits")


def test_full_fine_tuning_on_one_node_does_not_fit():
    _, plan = _plan("qwen3_5_35b_a3b_2nodes.yaml", 1)
    assert not plan.fits and plan.problems[0].startswith("optimizer step: 87.6 GiB")


def test_too_small_a_state_budget_is_a_problem():
    _, plan = _plan("qwen3_5_35b_a3b_2nodes.yaml", 2, ["rollout.mem_fraction=0.2265"])
    assert any("delta-net state" in p and "refuses to start" in p for p in plan.problems)


@pytest.mark.parametrize("config,nodes", sorted(SHIPPED))
def test_the_ledger_sizes_kv_and_state_like_the_plan(config, nodes, tmp_path):
    x, plan = _plan(config, nodes)
    path = tmp_path / "spec.json"
    mr.ledger_spec(plan, x, config).dump(str(path))
    spec = LedgerSpec.load(str(path))
    assert spec.hybrid["state_bytes_per_request"] == 16_097_280
    led = DeviceLedger(spec)
    led.moment("start-up")
    led.sglang_launch()  # the learner offloaded (colocated default): only the contexts held
    assert led.kv_tokens == plan.kv_tokens
    assert led.kv_bytes == plan.term("SGLang KV cache") + plan.term(hybrid.STATE_ROW)
    led.moment("generation")
    rep = led.report()
    gen = next(r for r in rep["moments"] if r["moment"] == "generation")
    assert gen["peak_bytes"] == gen["plan_bytes"] and rep["problems"] == []


# Dense plans before this change, byte for byte (`plan --ledger-spec` of the shipped config).
DENSE = {"qwen3_30b_a3b_1node.yaml": (1721924, {
    "learner weights": 8801644544, "gradient buffer": 17603289088,
    "main weights": 15272458240, "optimizer moments": 30544916480, "activations": 1661992960,
    "logits / log-probs": 6223298560, "SGLang weights": 15266061312,
    "SGLang KV cache": 42318004224}, {"generation": 62952774656, "training": 75443533824,
                                      "checkpoint": 73106306048}),
         "qwen3_8b_1node.yaml": (279423, {
             "learner weights": 8191043584, "gradient buffer": 16382087168,
             "main weights": 4095521792, "optimizer moments": 8191043584,
             "activations": 3959422976, "logits / log-probs": 12446597120,
             "SGLang weights": 16381470720, "SGLang KV cache": 41202597888},
             {"generation": 62952777728, "training": 56486941696, "checkpoint": 40080305152})}


@pytest.mark.parametrize("config", sorted(DENSE))
def test_dense_plans_are_unchanged(config):
    from megatron_gspo.config import load_config

    shape = "Qwen3-8B" if "8b" in config else "Qwen3-30B-A3B"
    cfg = load_config(GPU / config, [])
    hf = json.loads((GPU / "shapes" / shape / "config.json").read_text())
    x = mr.inputs_from_config(cfg, hf, gpu_bytes=GB80, gpus_per_node=8)
    plan = mr.build_plan(x)
    spec = mr.ledger_spec(plan, x, config)
    kv, sizes, moments = DENSE[config]
    assert plan.kv_tokens == kv and spec.hybrid is None and plan.state_slots is None
    assert {n: spec.sizes[n] for n in sizes} == sizes
    assert {n: spec.plan_moments[n] for n in moments} == moments
    assert hybrid.STATE_ROW not in spec.sizes


@pytest.mark.parametrize("config,nodes", sorted(SHIPPED))
def test_plan_command_prints_the_state_row_and_accepts(config, nodes, capsys):
    from megatron_gspo.cli import main

    args = ["plan", str(GPU / config), "--gpu-memory", "80GB", "--nodes", str(nodes),
            "--model-config", str(SHAPE)]
    assert main(args) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.strip().startswith(hybrid.STATE_ROW))
    assert "1296 slots x 16097280 B/request" in row and "259 requests at once" in row
    assert "2267045 tokens (10240 B/token, full-attention layers)" in out
    assert out.rstrip().splitlines()[-1] == "fits"
    assert main([*args, "--brief"]) == 0
    assert "delta-net state 1296 slots (259 requests at once)" in capsys.readouterr().out
