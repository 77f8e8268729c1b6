"""Our block-wise FP8 quantizer (DeepSeek-V3 format, megatron_gspo/quant/blockfp8.py) against
SGLang's own functions, run in the SGLang CPU venvs (scripts/sglang_cpu.sh) in a subprocess:
bytes of the FP8 weights and fp32 scales equal to SGLang's `bf16_to_block_fp8_128` (where the
release has it), and SGLang's `block_quant_dequant` of our (weight, scale_inv) equal to our
`dequantize`; SGLang's Fp8Config reads our quantization_config and skips exactly the modules
we keep. Tier `sglang_real` (about 40 s per release: SGLang's import); skipped (one line)
where a venv is not installed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from megatron_gspo.quant import blockfp8 as bf

pytestmark = pytest.mark.sglang_real

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_sglang_fp8_worker.py")
INSTALLS = {"0.5.23": ROOT / ".sglang-cpu-0.5.23", "0.5.12": ROOT / ".sglang-cpu"}
SHAPES = {"square": (256, 256), "partial": (300, 200), "tiny": (5, 7), "tall": (129, 1),
          "zero_block": (256, 256)}


# a 12-layer Qwen3-MoE's 2-D weights (HF names) and SGLang's module prefixes (fused q/k/v and
# gate/up, FusedMoE) -> whether our rule keeps them unquantized with keep_bf16_layers=1
MOE = {"model.embed_tokens.weight": (1000, 256), "lm_head.weight": (1000, 256),
       **{f"model.layers.{i}.{m}.weight": (256, 256) for i in range(12) for m in (
           "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate", "mlp.experts.0.gate_proj", "mlp.experts.0.up_proj",
           "mlp.experts.0.down_proj", "mlp.experts.1.down_proj")}}
PREFIXES = {**{f"model.layers.{i}.{m}": i in (0, 11) or m == "mlp.gate" for i in (0, 1, 10, 11)
               for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate", "mlp.experts")},
            "lm_head": True}


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {k: (torch.randn(s, generator=g) * 0.03).to(torch.bfloat16) for k, s in SHAPES.items()}
    out["zero_block"][128:, :128] = 0  # a zero block: amax floored at 1e-4 on both sides
    out["zero_block"][:128, 128:] *= 1e-4  # a tiny block under the floor
    out["fp32"] = torch.randn(200, 260, generator=g) * torch.logspace(-3, 0, 260)
    return out


@pytest.fixture(scope="module", params=sorted(INSTALLS))
def sglang_run(request, tmp_path_factory):
    """(release, SGLang's answers, our inputs) for one installed SGLang CPU venv."""
    from megatron_gspo.rollout.sglang.launch import cpu_server_env

    release = request.param
    py = INSTALLS[release] / "venv" / "bin" / "python"
    if not py.is_file():
        pytest.skip(f"SGLang {release} CPU venv not installed at {py.parent.parent} "
                    f"(scripts/sglang_cpu.sh {release})")
    weights = _weights()
    ours = {k: bf.quantize(w, k) for k, w in weights.items()}
    d = tmp_path_factory.mktemp(f"sglang_{release}")
    qc = bf.quantization_config(bf.modules_to_not_convert(MOE, 12, keep_bf16_layers=1))
    torch.save({"weights": weights, "ours": ours, "qc": qc, "prefixes": sorted(PREFIXES)},
               d / "in.pt")
    env = {"PATH": "/usr/bin:/bin", **cpu_server_env(str(py), {})}
    r = subprocess.run([str(py), str(WORKER), str(d / "in.pt"), str(d / "out.pt")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = torch.load(d / "out.pt")
    assert out["version"] == release, out["version"]
    return release, out, weights, ours


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_quantize_bytes_equal_sglangs(sglang_run):
    release, out, weights, ours = sglang_run
    if isinstance(out["quantize"], str):
        pytest.skip(f"SGLang {release} has no bf16_to_block_fp8_128 ({out['quantize']})")
    for k in weights:
        sq, ss = out["quantize"][k]
        q, s = ours[k]
        assert _same_bytes(q, sq), f"{k}: FP8 weight bytes differ from SGLang {release}'s"
        assert _same_bytes(s, ss), f"{k}: scale_inv bytes differ from SGLang {release}'s"
    print(f"\nSGLang {release}: {len(weights)} weights, "
          f"{sum(w.numel() for w in weights.values())} values, bytes equal")


def test_sglang_dequant_equals_ours(sglang_run):
    release, out, weights, ours = sglang_run
    if isinstance(out["dequant"], str):
        pytest.skip(f"SGLang {release} has no block_quant_dequant ({out['dequant']})")
    for k, (q, s) in ours.items():
        for dt in (torch.float32, torch.bfloat16):
            theirs = out["dequant"][k][str(dt)]
            assert _same_bytes(bf.dequantize(q, s, dt), theirs), f"{k} {dt}"
        rel = ((out["dequant"][k]["torch.float32"] - weights[k].float()).abs()
               / weights[k].float().abs().clamp(min=1e-3)).max()
        assert rel < 2.0 ** -4 + 1e-6, f"{k}: round trip through SGLang off by {rel:.3g}"


def test_sglang_reads_our_quantization_config(sglang_run):
    release, out, _, _ = sglang_run
    if isinstance(out["config"], str):
        pytest.skip(f"SGLang {release}: Fp8Config does not import ({out['config']})")
    assert out["config"]["serialized"] is True and out["config"]["block"] == [128, 128]
    assert out["config"]["activation_scheme"] == "dynamic"
    assert out["config"]["skipped"] == PREFIXES
