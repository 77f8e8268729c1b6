"""Block-wise FP8 (megatron_gspo/quant/blockfp8.py) bit for bit against the reference written
from the format's definition (tests/quant/blockfp8_reference.py), its edge cases (partial
blocks, zero and tiny blocks, ties, subnormals, saturation, inf / nan), and the rule which
parameters are quantized."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.quant import blockfp8 as bf
from tests.quant.blockfp8_reference import (
    e4m3fn_table,
    reference_dequantize,
    reference_quantize,
)

SHAPES = [(128, 128), (256, 384), (1, 1), (127, 129), (300, 200), (129, 1), (5, 700)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def test_table_is_torchs_e4m3fn():
    codes = torch.arange(0x7F, dtype=torch.uint8)
    assert torch.equal(codes.view(torch.float8_e4m3fn).to(torch.float64), e4m3fn_table())
    assert e4m3fn_table()[-1] == 448.0 == bf.FP8_MAX


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_exact_against_reference(shape, dtype):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    q, s = bf.quantize(w, "w")
    ref_q, ref_s = reference_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert torch.equal(_bits(q), ref_q)
    assert torch.equal(_bits(s), _bits(ref_s))
    # q * scale_inv is exact in float64; the float32 product is its one rounding
    deq = bf.dequantize(q, s, torch.float32)
    assert torch.equal(deq, reference_dequantize(ref_q, ref_s).to(torch.float32))


def test_edge_blocks_ties_subnormals_and_saturation():
    w = torch.zeros(256, 384)
    w[:128, :128] = torch.randn(128, 128) * 1e-6  # amax below the 1e-4 floor
    # block (0, 1): amax 448 -> scale 1: exact ties (1 + 1/16 -> 1, 1 + 3/16 -> 1.25),
    # subnormals (2^-9 * 1.5 -> tie) and values under the smallest subnormal
    vals = torch.tensor([448.0, -448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -9 * 1.5,
                         2.0 ** -11, -2.0 ** -11, 0.0, -0.0, 3.0, 240.0, 232.0])
    w[0, 128:128 + len(vals)] = vals
    w[128:, 256:] = -3.5  # constant block
    # block (1, 0) stays all zero
    q, s = bf.quantize(w, "edge")
    ref_q, ref_s = reference_quantize(w)
    assert torch.equal(_bits(q), ref_q) and torch.equal(_bits(s), _bits(ref_s))
    assert s[1, 0].item() == pytest.approx(1e-4 / 448) and s[0, 1].item() == 1.0
    got = q[0, 128:128 + len(vals)].float().tolist()
    assert got == [448.0, -448.0, 1.0, 1.25, -1.0, 2.0 ** -8, 0.0, -0.0, 0.0, -0.0, 3.0,
                   240.0, 224.0]
    assert torch.equal(bf.dequantize(q, s, torch.float32)[128:, :128], torch.zeros(128, 128))
    assert torch.equal(bf.dequantize(q, s, torch.float32)[128:, 256:], w[128:, 256:])


def test_round_trip_error_within_half_a_step():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(384, 260, generator=g) * torch.logspace(-3, 0, 260)  # mixed magnitudes
    q, s = bf.quantize(w)
    err = (bf.dequantize(q, s, torch.float32) - w).abs()
    s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:384, :260]
    # e4m3: 3 mantissa bits -> relative half-step 2^-4; subnormal step 2^-9 * scale
    bound = torch.maximum(w.abs() * 2.0 ** -4, s_full * 2.0 ** -10)
    assert bool((err <= bound * (1 + 1e-6)).all())
    print(f"\nround trip: max err / block amax {(err / (s_full * 448)).max():.4f}, "
          f"mean abs err {err.mean():.3g}")


def test_non_contiguous_input_and_input_left_unchanged():
    w = torch.randn(256, 384).t()  # [384, 256], non-contiguous, fp32 (no copy by .to)
    before = w.clone()
    q, s = bf.quantize(w)
    ref_q, ref_s = reference_quantize(w.contiguous())
    assert torch.equal(_bits(q), ref_q) and torch.equal(s, ref_s) and torch.equal(w, before)


def test_batched_leading_dims_match_per_matrix():
    w = torch.randn(3, 200, 130)
    q, s = bf.quantize(w)
    assert q.shape == (3, 200, 130) and s.shape == (3, 2, 2)
    for e in range(3):
        qe, se = bf.quantize(w[e])
        assert torch.equal(_bits(q[e]), _bits(qe)) and torch.equal(s[e], se)
    assert torch.equal(bf.dequantize(q, s, torch.float32)[2], bf.dequantize(qe, se, torch.float32))


@pytest.mark.parametrize("bad,what", [(float("nan"), "1 nan, 0 inf"),
                                      (float("inf"), "0 nan, 1 inf")])
def test_non_finite_input_is_one_line_naming_the_tensor(bad, what):
    w = torch.randn(130, 10)
    w[129, 3] = bad
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight: 1 "
                       rf"non-finite values \({what}\)") as e:
        bf.quantize(w, "model.layers.2.mlp.up_proj.weight")
    assert "\n" not in str(e.value)


def test_refuses_wrong_inputs():
    with pytest.raises(ValueError, match="w1: block FP8 needs a floating tensor"):
        bf.quantize(torch.ones(4), "w1")
    with pytest.raises(ValueError, match="w2: block FP8 needs"):
        bf.quantize(torch.ones(4, 4, dtype=torch.int32), "w2")
    q, s = bf.quantize(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"does not fit a weight of shape \(200, 300\)"):
        bf.dequantize(q, s[:, :2])


QWEN3_MOE = {
    "model.embed_tokens.weight": (100, 256),
    "lm_head.weight": (100, 256),
    "model.norm.weight": (256,),
    **{f"model.layers.{i}.{m}": s for i in range(4) for m, s in {
        "input_layernorm.weight": (256,),
        "self_attn.q_proj.weight": (256, 256),
        "self_attn.k_proj.weight": (128, 256),
        "self_attn.v_proj.weight": (128, 256),
        "self_attn.o_proj.weight": (256, 256),
        "self_attn.q_norm.weight": (64,),
        "mlp.gate.weight": (4, 256),
        "mlp.shared_expert_gate.weight": (1, 256),
        "mlp.experts.0.gate_proj.weight": (128, 256),
        "mlp.experts.0.up_proj.weight": (128, 256),
        "mlp.experts.0.down_proj.weight": (256, 128),
        "self_attn.q_proj.bias": (256,),
    }.items()},
    "model.layers.4.eh_proj.weight": (256, 512),  # an MTP layer past num_hidden_layers
}


def test_which_parameters_are_quantized():
    q = {n for n, s in QWEN3_MOE.items() if bf.is_quantized(n, s, 4)}
    assert q == {f"model.layers.{i}.{m}.weight" for i in range(4) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.experts.0.gate_proj", "mlp.experts.0.up_proj", "mlp.experts.0.down_proj")}
    assert not bf.is_quantized("model.layers.0.mlp.experts.gate_up_proj", (4, 8, 16), 4)
    assert not bf.is_quantized("model.layers.0.self_attn.indexer.weights_proj.weight",
                               (8, 256), 4)


def test_kept_layers_and_modules_to_not_convert():
    assert bf.kept_layers(4, 0) == set() and bf.kept_layers(4, 1) == {0, 3}
    assert bf.kept_layers(4, 3) == {0, 1, 2, 3}
    keep = bf.modules_to_not_convert(QWEN3_MOE, 4, keep_bf16_layers=1)
    assert "lm_head" in keep and "model.embed_tokens" in keep
    assert "model.layers.1.mlp.gate" in keep and "model.layers.2.mlp.shared_expert_gate" in keep
    assert "model.layers.0.self_attn.q_proj" in keep and "model.layers.3.mlp.experts.0.up_proj" \
        in keep
    assert "model.layers.1.self_attn.q_proj" not in keep
    assert not any("norm" in m for m in keep) and keep == sorted(keep)
    qc = bf.quantization_config(keep)
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128], "modules_to_not_convert": keep}
    with pytest.raises(ValueError, match="keep_bf16_layers must be >= 0"):
        bf.kept_layers(4, -1)


def test_fused_modules_quantize_whole_or_not_at_all():
    assert bf.fused_module("model.layers.3.self_attn.k_proj.weight") == \
        "model.layers.3.self_attn.qkv_proj"
    assert bf.fused_module("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert bf.fused_module("model.layers.3.mlp.experts.7.down_proj.weight") == \
        "model.layers.3.mlp.experts"
    assert bf.fused_module("model.layers.3.self_attn.o_proj.weight") is None
    assert bf.quantized_names(QWEN3_MOE, 4) == {n for n, s in QWEN3_MOE.items()
                                                if bf.is_quantized(n, s, 4)}
    shapes = dict(QWEN3_MOE)
    shapes["model.layers.1.self_attn.k_proj.weight"] = (64, 256)  # half a block of rows
    shapes["model.layers.2.mlp.experts.0.up_proj.weight"] = (96, 256)  # moe_intermediate 96
    shapes["model.layers.2.mlp.experts.0.down_proj.weight"] = (256, 96)
    q = bf.quantized_names(shapes, 4)
    keep = bf.modules_to_not_convert(shapes, 4)
    for m in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.1.self_attn.{m}.weight" not in q
        assert f"model.layers.1.self_attn.{m}" in keep
        assert f"model.layers.0.self_attn.{m}.weight" in q
    assert "model.layers.1.self_attn.o_proj.weight" in q
    assert not any(".layers.2.mlp.experts." in n for n in q)
    assert "model.layers.2.mlp.experts.0.down_proj" in keep
    assert "model.layers.3.mlp.experts.0.down_proj.weight" in q


def test_per_rank_parts_off_the_grid_stay_unquantized_with_their_fused_module():
    """SGLang's validate_block_quant_shapes at the servers' TP size: column-parallel parts need
    N / tp, row-parallel ones K / tp on the 128 grid (Qwen3-30B-A3B's experts: I = 768 gives 96
    rows per rank at TP 8, which SGLang refuses)."""
    from megatron_gspo.quant.blockfp8 import fits_per_rank, quantized_names

    shapes = {"model.layers.0.self_attn.q_proj.weight": (2048, 1024),
              "model.layers.0.self_attn.k_proj.weight": (512, 1024),
              "model.layers.0.self_attn.v_proj.weight": (512, 1024),
              "model.layers.0.self_attn.o_proj.weight": (1024, 2048),
              "model.layers.0.mlp.experts.0.gate_proj.weight": (768, 1024),
              "model.layers.0.mlp.experts.0.up_proj.weight": (768, 1024),
              "model.layers.0.mlp.experts.0.down_proj.weight": (1024, 768)}
    assert quantized_names(shapes, 1, 0, tp_size=1) == set(shapes)
    at4 = quantized_names(shapes, 1, 0, tp_size=4)  # k/v: 128 rows per rank; experts: 192
    assert at4 == {n for n in shapes if "experts" not in n}
    at8 = quantized_names(shapes, 1, 0, tp_size=8)  # k/v: 64 rows per rank: all of qkv stays
    assert at8 == {"model.layers.0.self_attn.o_proj.weight"}
    assert not fits_per_rank("x.layers.0.mlp.down_proj.weight", (1024, 768), 8)
    assert fits_per_rank("x.layers.0.mlp.down_proj.weight", (1000, 1024), 8)
