"""HF config.json -> TransformerConfig mapping and parallel-layout validation (no processes)."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.megatron.models.builder import (SUPPORTED_ARCHITECTURES, ModelConfigError,
                                          build_model_config, padded_vocab_size)
from megatron_gspo.megatron.parallel import ParallelLayout, ParallelLayoutError, check_layout

BASE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128,
            num_hidden_layers=4, vocab_size=1000, rms_norm_eps=1e-5, rope_theta=5e5,
            hidden_act="silu")


def cfg(arch, **kw):
    return dict(BASE, architectures=[arch], **kw)


def test_qwen3_moe_mapping():
    c = build_model_config(cfg("Qwen3MoeForCausalLM", head_dim=16, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=32,
                               norm_topk_prob=True), use_te=False)
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups) == (
        4, 64, 8, 2)
    assert c.kv_channels == 16 and c.qk_layernorm and not c.add_qkv_bias
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 2, 32)
    assert c.moe_router_pre_softmax is False  # norm_topk_prob: softmax over the top-k
    assert c.normalization == "RMSNorm" and c.layernorm_epsilon == 1e-5
    assert c.gated_linear_unit and not c.add_bias_linear
    no_norm = build_model_config(cfg("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=32, norm_topk_prob=False),
                                 use_te=False)
    assert no_norm.moe_router_pre_softmax is True


def test_llama_qwen2_mapping_and_dtype():
    llama = build_model_config(cfg("LlamaForCausalLM"), params_dtype=torch.bfloat16,
                               use_te=False)
    assert llama.kv_channels == 8 and not llama.qk_layernorm and llama.bf16
    qwen2 = build_model_config(cfg("Qwen2ForCausalLM"), use_te=False)
    assert qwen2.add_qkv_bias and not qwen2.qk_layernorm


def test_bad_configs_are_named():
    with pytest.raises(ModelConfigError, match="supported: " + SUPPORTED_ARCHITECTURES[0]):
        build_model_config(cfg("GPT2LMHeadModel"))
    with pytest.raises(ModelConfigError, match="hidden_act"):
        build_model_config(cfg("LlamaForCausalLM", hidden_act="gelu"))
    with pytest.raises(ModelConfigError, match="rope_scaling type 'yarn'"):
        build_model_config(cfg("LlamaForCausalLM", rope_scaling={"rope_type": "yarn"}))
    with pytest.raises(ModelConfigError, match="num_experts"):
        build_model_config(cfg("Qwen3MoeForCausalLM"))
    assert padded_vocab_size(1000) == 1024 and padded_vocab_size(1024) == 1024
    assert padded_vocab_size(1000, 128, 2) == 1024 and padded_vocab_size(1000, 128, 3) == 1152


def test_layout_errors_reported_together():
    hf = cfg("Qwen3MoeForCausalLM", num_experts=6, num_experts_per_tok=2,
             moe_intermediate_size=32)
    with pytest.raises(ParallelLayoutError) as e:
        check_layout(ParallelLayout(tensor=4, pipeline=3, expert=4), 24, hf)
    msg = str(e.value)
    for part in ("num_key_value_heads=2", "num_hidden_layers=4", "num_experts=6",
                 "sequence_parallel"):
        assert part in msg
    with pytest.raises(ParallelLayoutError, match="not divisible by tensor"):
        check_layout(ParallelLayout(tensor=2, pipeline=2), 6)
    assert check_layout(ParallelLayout(tensor=2, pipeline=2), 8, cfg("LlamaForCausalLM")) == 2
