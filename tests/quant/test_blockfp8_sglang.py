"""Our block-wise FP8 quantizer (DeepSeek-V3 format, megatron_gspo/quant/blockfp8.py) against
SGLang's own functions, run in the SGLang CPU venvs (scripts/sglang_cpu.sh) in a subprocess:
bytes of the FP8 weights and fp32 scales equal to SGLang's `bf16_to_block_fp8_128` (where the
release has it), and SGLang's `block_quant_dequant` of our (weight, scale_inv) equal to our
`dequantize`. Tier `sglang_real` (about 40 s per release: SGLang's import); skipped (one line)
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
    torch.save({"weights": weights, "ours": ours}, d / "in.pt")
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
