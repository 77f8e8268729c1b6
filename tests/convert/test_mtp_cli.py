"""`convert_checkpoint.py hf-to-mcore` / `mcore-to-hf` keep the multi-token-prediction layer of
a DeepSeek-V3 / GLM-4.5 checkpoint (tests/convert/tiny_mtp.py) bit for bit through a
distributed checkpoint written under TP2+EP2 (sequence parallel, as MoE conversion builds) and
read back under PP2 (the MTP block lives on the last stage), and the reverse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.convert.tiny_mtp import make_mtp_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _cli(*argv: str) -> None:
    cli = [sys.executable, "-W", "ignore", str(ROOT / "tools" / "convert_checkpoint.py")]
    p = subprocess.run([*cli, *argv, "--no-progress"], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"])
@pytest.mark.parametrize("write,read", [(("--tp", "2", "--ep", "2"), ("--pp", "2")),
                                        (("--pp", "2"), ("--tp", "2", "--ep", "2"))])
def test_cli_roundtrip_keeps_the_mtp_layer_bit_exact(arch, write, read, tmp_path):
    from safetensors.torch import load_file

    sd = make_mtp_checkpoint(arch, tmp_path / "hf")
    _cli("hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck"), *write)
    _cli("mcore-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "back"), *read)
    got = {}
    for f in (tmp_path / "back").glob("*.safetensors"):
        got.update(load_file(f))
    assert sorted(got) == sorted(sd)
    bad = [k for k in sd if got[k].dtype != sd[k].dtype or not torch.equal(got[k], sd[k])]
    assert not bad, bad
