"""DeepSeek-V3's HF config -> MLATransformerConfig mapping, its one-line refusals of what
Megatron-Core 0.16.1 cannot express, its Transformer Engine parameter spelling, and the pieces
the weight sync and routing replay need for it (no processes)."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.convert import get_adapter
from megatron_gspo.convert.param_map import from_te_name, num_routed_experts
from megatron_gspo.megatron.io.weight_export import bucketize
from megatron_gspo.megatron.models.builder import ModelConfigError, build_model_config
from megatron_gspo.megatron.moe.routing_exchange import all_layer_rows, moe_layer_indices
from tests.convert.tiny_families import DEEPSEEK_V3


def test_mapping_keeps_mla_router_and_layer_pattern():
    c = build_model_config(dict(DEEPSEEK_V3), use_te=False)
    assert c.multi_latent_attention and type(c).__name__ == "MLATransformerConfig"
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim,
            c.v_head_dim) == (24, 16, 8, 4, 12)
    assert (c.rope_type, c.rotary_scaling_factor, c.original_max_position_embeddings,
            c.beta_fast, c.beta_slow, c.mscale, c.mscale_all_dim) == (
        "yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert c.moe_layer_freq == [0, 1, 1, 1]  # first_k_dense_replace = 1
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 4, 16)
    assert c.moe_shared_expert_intermediate_size == 16 and not c.moe_shared_expert_gate
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_router_bias_update_rate == 0.0  # the bias stays what the engine routes with
    assert (c.moe_router_num_groups, c.moe_router_group_topk) == (4, 2)
    assert c.moe_router_topk_scaling_factor == 2.5
    assert c.moe_router_load_balancing_type == "none"
    assert num_routed_experts(DEEPSEEK_V3) == 8


@pytest.mark.parametrize("change, words", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false"),
    (dict(topk_group=1), "topk_group=1"),
    (dict(rope_interleave=False), "rope_interleave=false"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(topk_method="greedy"), "topk_method='greedy'"),
    (dict(rope_scaling={"type": "llama3", "factor": 8.0}), "rope type 'llama3'"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace=9"),
])
def test_unsupported_fields_are_one_line_errors(change, words):
    with pytest.raises(ModelConfigError) as e:
        build_model_config({**DEEPSEEK_V3, **change}, use_te=False)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_te_spelling_round_trips_and_keeps_mla_input_norm():
    cfg = dict(DEEPSEEK_V3)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    te = {pm.mcore: adapter.spell(pm.mcore, dims, "te") for pm in adapter.param_maps(dims)}
    assert te["decoder.layers.1.input_layernorm.weight"] == (
        "decoder.layers.1.input_layernorm.weight")  # MLA: not fused into a linear
    assert te["decoder.layers.1.self_attention.q_layernorm.weight"] == (
        "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight")
    assert te["decoder.layers.0.pre_mlp_layernorm.weight"] == (
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight")  # dense layer: fused
    assert te["decoder.layers.1.pre_mlp_layernorm.weight"] == (
        "decoder.layers.1.pre_mlp_layernorm.weight")  # MoE layer: its own module
    assert te["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"] == (
        "decoder.layers.1.mlp.experts.linear_fc2.weight3")
    assert all(from_te_name(t) == c for c, t in te.items())
    hf = set(adapter.hf_names(dims))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in hf
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in hf
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in hf)


def test_bucket_groups_keep_qkv_a_pairs_together():
    cfg = dict(DEEPSEEK_V3)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    names = ["model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_b_proj.weight",
             "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.norm.weight"]
    items = [(n, torch.zeros(8)) for n in names]  # 32 bytes each, bound 40: one per bucket
    buckets = [[n for n, _ in b] for b in bucketize(
        iter(items), 40, together=lambda n: adapter.bucket_group(n, dims))]
    assert [names[1]] in buckets and [names[3]] in buckets
    assert [names[0], names[2]] in buckets  # held back until its partner arrived
    assert [[n for n, _ in b] for b in bucketize(iter(items), 40)] == [[n] for n in names]


def test_engine_routing_of_moe_layers_spreads_over_decoder_layers():
    moe = moe_layer_indices([0, 1, 1, 1], 4)
    assert moe == [1, 2, 3] and moe_layer_indices(1, 3) == [0, 1, 2]
    rows = torch.arange(2 * 3 * 2).reshape(2, 3, 2)  # [T, MoE layers, k]
    full = all_layer_rows(rows, moe, 4)
    assert full.shape == (2, 4, 2) and (full[:, 0] == -1).all() and torch.equal(full[:, 1:], rows)
    assert all_layer_rows(full, moe, 4) is full  # already per decoder layer


def test_down_projections_are_replicated_and_mapped_unsplit():
    """The local spec builds MLA's down projections as the replicated `Linear` MLA accepts (as
    the TE spec's duplicated `TELinear`), and the adapter maps them without a TP split."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import multi_latent_attention

    from megatron_gspo.megatron.compat import submodules
    from megatron_gspo.megatron.models.deepseek_v3 import replicated_down_projections

    spec = replicated_down_projections(get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"))
    attn = submodules(spec.submodules.self_attention)
    assert multi_latent_attention.Linear is not None  # bound without TE on 0.19 too
    assert attn.linear_q_down_proj is attn.linear_kv_down_proj is multi_latent_attention.Linear
    adapter = get_adapter(DEEPSEEK_V3)
    maps = adapter.maps_by_mcore(adapter.dims(DEEPSEEK_V3))
    a = "decoder.layers.0.self_attention."
    assert maps[a + "linear_q_down_proj.weight"].tp_dim is None
    assert maps[a + "linear_kv_down_proj.weight"].tp_dim is None
    assert maps[a + "linear_q_up_proj.weight"].tp_dim == 0
