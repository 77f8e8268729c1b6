"""GLM-4.5 MoE's HF config -> TransformerConfig mapping (DeepSeek-V3's router and layer pattern,
GQA attention with q/k/v biases, q/k norms, partial rotary) and its adapter's names."""

from __future__ import annotations

import pytest

from megatron_gspo.convert import get_adapter
from megatron_gspo.megatron.models.builder import ModelConfigError, build_model_config
from tests.convert.tiny_families import GLM4_MOE


def test_mapping_router_pattern_and_attention():
    c = build_model_config(dict(GLM4_MOE), use_te=False)
    assert not c.multi_latent_attention and c.add_qkv_bias and not c.add_bias_linear
    assert c.qk_layernorm and (c.num_query_groups, c.kv_channels) == (2, 16)
    assert c.moe_layer_freq == [0, 1, 1, 1] and c.moe_shared_expert_intermediate_size == 16
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_router_num_groups is None and c.moe_router_topk_scaling_factor == 2.5
    air = build_model_config({**GLM4_MOE, "use_qk_norm": False}, use_te=False)
    assert not air.qk_layernorm


@pytest.mark.parametrize("change, words", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
    (dict(mlp_bias=True), "mlp_bias=true"),
    (dict(n_group=4, topk_group=1), "topk_group=1"),
])
def test_unsupported_fields_are_one_line_errors(change, words):
    with pytest.raises(ModelConfigError) as e:
        build_model_config({**GLM4_MOE, **change}, use_te=False)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_adapter_names_and_te_spelling():
    cfg = dict(GLM4_MOE)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    by_hf = {h: pm for pm in adapter.param_maps(dims) for h in pm.hf}
    assert by_hf["model.layers.1.self_attn.q_proj.bias"].kind == "qkv_bias"
    assert "model.layers.1.self_attn.o_proj.bias" not in by_hf
    assert by_hf["model.layers.2.mlp.gate.e_score_correction_bias"].mcore == (
        "decoder.layers.2.mlp.router.expert_bias")
    assert "model.layers.0.mlp.gate_proj.weight" in by_hf  # leading dense layer
    te = adapter.spell("decoder.layers.0.input_layernorm.weight", dims, "te")
    assert te == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert adapter.spell("decoder.layers.1.pre_mlp_layernorm.weight", dims, "te") == (
        "decoder.layers.1.pre_mlp_layernorm.weight")
    assert adapter.bucket_group("model.layers.1.self_attn.q_proj.weight", dims) is None
