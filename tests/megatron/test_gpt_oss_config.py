"""gpt-oss's HF config -> TransformerConfig mapping (sinks, windows, YaRN with its attention
factor in the softmax scale, clamped SwiGLU, biases), its refusals, and its fused expert tensors
(no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.convert import get_adapter
from megatron_gspo.convert.param_map import ConversionError, to_hf_tensors, to_mcore_tensor
from megatron_gspo.megatron.models.builder import ModelConfigError, build_model_config
from megatron_gspo.megatron.parallel import ParallelLayout, ParallelLayoutError, check_layout
from tests.convert.tiny_families import GPT_OSS


def test_mapping_sinks_windows_yarn_and_experts():
    c = build_model_config(dict(GPT_OSS), use_te=False)
    assert c.softmax_type == "learnable" and c.add_bias_linear and c.add_qkv_bias
    assert c.window_size == (4, 0) and c.window_attn_skip_freq == [1, 0, 1, 0]
    assert c.position_embedding_type == "yarn" and c.yarn_rotary_scaling_factor == 32.0
    assert c.yarn_correction_range_round_to_int is False  # truncate=false
    af = 0.1 * math.log(32.0) + 1.0  # transformers' yarn attention factor on cos / sin
    assert c.softmax_scale == pytest.approx(af * af / math.sqrt(16))
    assert (c.activation_func_clamp_value, c.glu_linear_offset) == (0.1, 1.0)
    assert c.activation_func.__name__ == "quick_gelu" and c.moe_router_pre_softmax is False
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 2, 16)


@pytest.mark.parametrize("change, words", [
    (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope type 'llama3'"),
])
def test_unsupported_fields_are_one_line_errors(change, words):
    with pytest.raises(ModelConfigError) as e:
        build_model_config({**GPT_OSS, **change}, use_te=False)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_quantized_checkpoints_and_expert_tp_are_refused():
    with pytest.raises(ConversionError, match="mxfp4"):
        get_adapter(dict(GPT_OSS)).dims({**GPT_OSS,
                                         "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ParallelLayoutError, match="expert_tensor=1"):
        check_layout(ParallelLayout(tensor=2, sequence_parallel=True), 2, dict(GPT_OSS))
    with pytest.raises(ParallelLayoutError, match="needs parallel.expert > 1"):
        check_layout(ParallelLayout(tensor=2, sequence_parallel=True, expert_tensor=1), 2,
                     dict(GPT_OSS))
    check_layout(ParallelLayout(tensor=2, sequence_parallel=True, expert=2, expert_tensor=1), 2,
                 dict(GPT_OSS))


def test_fused_expert_slices_deinterleave_and_round_trip():
    cfg = dict(GPT_OSS)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    maps = {pm.mcore: pm for pm in adapter.param_maps(dims)}
    fc1 = maps["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    gate_up = torch.randn(8, 64, 32)  # [E, H, 2F], gate / up interleaved along 2F
    m = to_mcore_tensor(fc1, [gate_up], dims, 0)  # [2F, H] = [gate; up]
    assert torch.equal(m[:16], gate_up[3, :, 0::2].t())
    assert torch.equal(m[16:], gate_up[3, :, 1::2].t())
    assert torch.equal(to_hf_tensors(fc1, m, dims)[0], gate_up[3])
    full = {name: torch.randn(shape) for pm in adapter.param_maps(dims)
            for name, shape in zip(pm.hf, pm.shapes, strict=True)}
    mc = adapter.hf_to_mcore(full.__getitem__, dims, padded_vocab=160)
    back = adapter.mcore_to_hf(mc, dims)
    assert sorted(back) == sorted(full) and all(torch.equal(back[k], full[k]) for k in full)


def _te_grouped_mlp_refuses(c) -> bool:
    """Megatron-Core 0.16.1's TEGroupedMLP.__init__ (transformer/moe/experts.py) asserts
    `not (self.config.add_bias_linear and config.bias_dropout_fusion)`; the TE spec builds
    TEGroupedMLP for grouped-GEMM experts. The condition is read from the installed source, so
    a changed upstream check shows here."""
    import inspect

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    src = " ".join(inspect.getsource(TEGroupedMLP.__init__).split())
    assert "assert not ( self.config.add_bias_linear and config.bias_dropout_fusion )" in src
    return bool(c.num_moe_experts and c.moe_grouped_gemm and c.add_bias_linear
                and c.bias_dropout_fusion)


def test_te_spec_config_passes_te_grouped_mlp_bias_check():
    """gpt-oss on the Transformer Engine spec (what `transformer_impl: auto` picks where TE
    imports) builds TEGroupedMLP experts with biases: the config must not ask for the bias +
    dropout fusion TEGroupedMLP refuses. The early check builds with use_te=False (local spec,
    no grouped GEMM): that config is valid too and keeps its biases."""
    te = build_model_config(dict(GPT_OSS), use_te=True)
    assert te.moe_grouped_gemm and te.add_bias_linear
    assert not _te_grouped_mlp_refuses(te)
    local = build_model_config(dict(GPT_OSS), use_te=False)
    assert local.add_bias_linear and not local.moe_grouped_gemm
    assert not _te_grouped_mlp_refuses(local)


def test_te_spec_config_asking_for_the_refused_fusion_is_a_one_line_error():
    with pytest.raises(ModelConfigError) as e:
        build_model_config(dict(GPT_OSS), use_te=True, bias_dropout_fusion=True)
    assert "bias_dropout_fusion" in str(e.value) and "\n" not in str(e.value)
    build_model_config(dict(GPT_OSS), use_te=False, bias_dropout_fusion=True)  # local: fine
