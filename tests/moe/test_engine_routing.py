"""The embedded engine's MoE routing (`return_routing`) and per-expert weight updates into
transformers 5's fused expert tensors, on the shipped MoE demo model."""

from pathlib import Path

import pytest
import torch

from megatron_gspo.data.sample import Sample, SampleError
from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
from megatron_gspo.rollout.embedded import EmbeddedEngine, RoutingCapture, fused_expert_slice

BASE = Path(__file__).resolve().parents[2] / "examples" / "moe" / "base"


def _direct_routing(model, tokens: list[int]) -> torch.Tensor:
    """[T, layers, k] top-k experts of one unpadded full forward."""
    from megatron_gspo.rollout.embedded import moe_routers

    cap = RoutingCapture(moe_routers(model))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]))
        cap.end_forward()
    finally:
        cap.close()
    return cap.forwards[0]


def test_engine_routing_rows_equal_a_full_forward():
    eng = EmbeddedEngine(str(BASE), dtype="float32", seed=3, return_routing=True)
    prompt = [1, 40, 45, 50, 51, 52, 2, 10, 1, 60]
    req = GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(
        n=3, temperature=1.0, max_new_tokens=6, ignore_eos=True))
    samples = eng.generate([req])
    assert len(samples) == 3
    for s in samples:
        t = len(s.prompt_ids) + len(s.response_ids)
        assert s.routing.shape == (t - 1, 2, 2) and s.routing.dtype == torch.int32
        direct = _direct_routing(eng.model, s.tokens[:-1])
        # same experts per token (order inside the top-k as torch.topk returns it)
        assert torch.equal(s.routing.sort(-1).values, direct.sort(-1).values.to(torch.int32))
        assert int(s.routing.min()) >= 0 and int(s.routing.max()) < 8


def test_engine_without_routing_and_dense_model_refusal(tmp_path):
    eng = EmbeddedEngine(str(BASE), dtype="float32", seed=3)
    s = eng.generate([GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(
        max_new_tokens=2))])[0]
    assert s.routing is None
    dense = dict(model_type="qwen3", vocab_size=64, hidden_size=16, intermediate_size=32,
                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="no MoE router"):
        EmbeddedEngine(dense, return_routing=True)


def test_sample_routing_length_is_checked():
    r = torch.zeros(4, 2, 2, dtype=torch.int32)
    Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], routing=r)  # 5 tokens, 4 rows
    with pytest.raises(SampleError, match=r"routing has shape \(3, 2, 2\)"):
        Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], routing=r[:3])
    d = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], routing=r).to_dict()
    assert d["routing"] == r.tolist()
    assert torch.equal(Sample(**d).routing, r)  # back from JSON


def test_per_expert_weight_names_update_fused_tensors():
    eng = EmbeddedEngine(str(BASE), dtype="float32", seed=0)
    params = dict(eng.model.named_parameters())
    fused = params["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2F, H]
    f = fused.shape[1] // 2
    gate = torch.randn(f, fused.shape[2])
    up = torch.randn(f, fused.shape[2])
    down = torch.randn(params["model.layers.1.mlp.experts.down_proj"].shape[1:])
    n = eng.load_buckets([[("model.layers.1.mlp.experts.5.gate_proj.weight", gate),
                           ("model.layers.1.mlp.experts.5.up_proj.weight", up),
                           ("model.layers.1.mlp.experts.5.down_proj.weight", down)]], version=4)
    assert n == 3 and eng.weight_version == 4
    assert torch.equal(fused[5, :f], gate) and torch.equal(fused[5, f:], up)
    assert torch.equal(params["model.layers.1.mlp.experts.down_proj"][5], down)
    assert fused_expert_slice(params, "model.layers.1.mlp.experts.99.up_proj.weight") is None
    with pytest.raises(KeyError, match="unknown parameter name"):
        eng.load_buckets([[("model.layers.7.mlp.experts.0.up_proj.weight", up)]], version=5)
