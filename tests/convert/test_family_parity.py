"""Megatron-Core logits equal transformers' for the families beyond Llama / Qwen, on tiny
random models shaped like the released configs (tests/convert/tiny_families.py): under one
process and under TP2, PP2 and EP2 (MoE families), max abs error <= 1e-5 in fp32; the
exported HF tensors equal the originals bit for bit in every layout; a checkpoint saved under
TP2 / EP2 loads into one process with the same logits. The max errors are printed
(`pytest -s`) and written to `parity.json` in the test's work directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tests.convert.tiny_families import FAMILIES, make_family_model

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_parity_worker.py")
TOL = 1e-5


def _launch(work: Path, hf_dir: Path, world: int, layouts: list[str], tag: str) -> dict:
    args = dict(hf_dir=str(hf_dir), refs_path=str(work / "refs.pt"), work=str(work),
                layouts=layouts, tag=tag, world=world)
    p = subprocess.run([sys.executable, "-W", "ignore", str(WORKER), json.dumps(args)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    merged: dict = {}
    for r in range(world):
        for k, v in json.loads((work / f"parity.{tag}.rank{r}.json").read_text()).items():
            if v is not None:
                merged[k] = max(v, merged.get(k, 0.0))
    return merged


def _family_run(arch: str, tmp: Path, multi: bool) -> dict:
    hf_dir = tmp / "hf"
    model = make_family_model(arch, hf_dir)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.save({"tokens": tokens, "logits": model(tokens).logits}, tmp / "refs.pt")
    errs = {}
    if multi:
        errs.update(_launch(tmp, hf_dir, 2, ["tp2", "pp2", "ep2"], "multi"))
    errs.update(_launch(tmp, hf_dir, 1, ["single"], "one"))
    (tmp / "parity.json").write_text(json.dumps(errs, indent=1))
    print(f"\n{arch} max |logits - transformers| per layout: {errs}")
    return errs


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_single_process_logits_match_transformers(arch, tmp_path):
    errs = _family_run(arch, tmp_path, multi=False)
    assert errs["single"] <= TOL, errs


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_tp2_pp2_ep2_logits_match_transformers(arch, tmp_path):
    errs = _family_run(arch, tmp_path, multi=True)
    moe = transformers.AutoConfig.from_pretrained(tmp_path / "hf").to_dict().get(
        "n_routed_experts") or FAMILIES[arch][1].get("num_local_experts")
    want = {"single", "tp2", "pp2", "single_from_tp2_ckpt"} | (
        {"ep2", "single_from_ep2_ckpt"} if moe else set())
    assert want <= set(errs), errs
    assert all(v <= TOL for v in errs.values()), errs
