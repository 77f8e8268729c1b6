"""Gemma 3's HF config -> TransformerConfig mapping, its one-line refusals, the TE-spec refusal
of its adapter, and the sliding window of the packed local attention (no processes)."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.convert import get_adapter
from megatron_gspo.convert.param_map import ConversionError
from megatron_gspo.megatron.models.builder import ModelConfigError, build_model_config
from tests.convert.tiny_families import GEMMA3


def test_mapping_windows_rope_bases_and_scale():
    c = build_model_config(dict(GEMMA3))  # use_te=None: Gemma 3 builds the local spec
    assert c.window_size == (4, 0) and c.window_attn_skip_freq == [1, 1, 1, 1, 1, 0]
    assert c.local_rotary_base == 10000.0 and c.qk_layernorm and c.kv_channels == 16
    assert c.softmax_scale == pytest.approx(24 ** -0.5)
    assert c.gated_linear_unit and c.activation_func.keywords == {"approximate": "tanh"}
    types = dict(GEMMA3, layer_types=["full_attention"] * 6)
    assert build_model_config(types, use_te=False).window_size is None


@pytest.mark.parametrize("change, words", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=true"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
])
def test_unsupported_fields_are_one_line_errors(change, words):
    with pytest.raises(ModelConfigError) as e:
        build_model_config({**GEMMA3, **change}, use_te=False)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_transformer_engine_spec_is_refused_in_one_line():
    with pytest.raises(ModelConfigError, match="sandwich norms") as e:
        build_model_config(dict(GEMMA3), use_te=True)
    assert "\n" not in str(e.value)
    adapter = get_adapter(dict(GEMMA3))
    dims = adapter.dims(dict(GEMMA3))
    with pytest.raises(ConversionError, match="no Transformer Engine layer spec"):
        adapter.spell("decoder.layers.0.input_layernorm.weight", dims, "te")
    hf = {pm.hf[0]: pm.mcore for pm in adapter.param_maps(dims)}
    assert hf["model.layers.0.post_attention_layernorm.weight"] == (
        "decoder.layers.0.self_attention.linear_proj.post_norm.weight")
    assert hf["model.layers.0.pre_feedforward_layernorm.weight"] == (
        "decoder.layers.0.pre_mlp_layernorm.weight")
    assert hf["model.layers.0.post_feedforward_layernorm.weight"] == (
        "decoder.layers.0.mlp.linear_fc2.post_norm.weight")


def test_packed_attention_window_keeps_segments_apart():
    """Two packed segments through the segment path with a window of 3 (left=2) equal each
    segment attended alone with the band mask; Megatron-Core's own torch softmax would replace
    the block mask by the window mask and let the second segment see the first."""
    from megatron_gspo.megatron.models.local_layers import PackedDotProductAttention, _segment_plan

    class Stub:
        softmax_scale, layer_number, softmax_offset = 0.5, 1, None
        config = type("C", (), {"attention_softmax_in_fp32": True,
                                "apply_query_key_layer_scaling": False})()

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 2, 4, generator=g) for _ in range(3))
    cu = torch.tensor([0, 5, 9])
    got = PackedDotProductAttention._segment_attention(Stub(), q, k, v,
                                                       _segment_plan(cu, "cpu"), (2, 0))
    for a, b in ((0, 5), (5, 9)):
        n = b - a
        i = torch.arange(n)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= 2)
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * 0.5
        p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        want = torch.einsum("hqk,khd->qhd", p, v[a:b]).reshape(n, 1, 8)
        assert torch.allclose(got[a:b], want, atol=1e-6)
