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

from tests.convert.tiny_families import FAMILIES, fast_first, make_family_model

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
            if v is not None and k.endswith("_bucket_groups"):
                merged.setdefault("bucket_groups", {})[k.split("_")[0]] = v
            elif v is not None:
                merged[k] = max(v, merged.get(k, 0.0))
    return merged


def _family_run(arch: str, tmp: Path, multi: bool) -> dict:
    hf_dir = tmp / "hf"
    model = make_family_model(arch, hf_dir)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.save({"tokens": tokens, "logits": model(tokens).logits}, tmp / "refs.pt")
    runs = [_launch(tmp, hf_dir, 2, ["tp2", "pp2", "ep2"], "multi")] if multi else []
    runs.append(_launch(tmp, hf_dir, 1, ["single"], "one"))
    errs = {"bucket_groups": {}}
    for run in runs:
        errs["bucket_groups"].update(run.pop("bucket_groups", {}))
        errs.update(run)
    (tmp / "parity.json").write_text(json.dumps(errs, indent=1))
    print(f"\n{arch} max |logits - transformers| per layout: {errs}")
    return errs


@pytest.mark.parametrize("arch", [fast_first(a) for a in sorted(FAMILIES)])
def test_single_process_logits_match_transformers(arch, tmp_path):
    errs = _family_run(arch, tmp_path, multi=False)
    assert errs["single"] <= TOL, errs
    if arch == "DeepseekV3ForCausalLM":  # q_a_proj + kv_a_proj_with_mqa of every layer
        assert errs["bucket_groups"]["single"] == FAMILIES[arch][1]["num_hidden_layers"]


def test_deepseek_tiny_model_routing_depends_on_bias_and_groups(tmp_path):
    """The tiny DeepSeek-V3 is shaped so that the expert bias and the group limit change its
    logits: parity on it covers both."""
    model = make_family_model("DeepseekV3ForCausalLM", tmp_path)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(tokens).logits
        gates = [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
        for g in gates:
            g.num_group = g.topk_group = 1
        no_groups = model(tokens).logits
        for g in gates:
            g.num_group, g.topk_group = 4, 2
            g.e_score_correction_bias.zero_()
        no_bias = model(tokens).logits
    assert (ref - no_groups).abs().max() > 1e-3 and (ref - no_bias).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_tp2_pp2_ep2_logits_match_transformers(arch, tmp_path):
    errs = _family_run(arch, tmp_path, multi=True)
    moe = transformers.AutoConfig.from_pretrained(tmp_path / "hf").to_dict().get(
        "n_routed_experts") or FAMILIES[arch][1].get("num_local_experts")
    want = {"single", "tp2", "pp2", "single_from_tp2_ckpt"} | (
        {"ep2", "single_from_ep2_ckpt"} if moe else set())
    assert want <= set(errs), errs
    groups = errs.pop("bucket_groups")
    assert all(v <= TOL for v in errs.values()), errs
    assert len(set(groups.values())) == 1, groups  # every layout exports the same groups


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_cli_roundtrip_through_a_tp2_ep2_checkpoint_is_bit_exact(arch, tmp_path):
    from safetensors.torch import load_file

    from megatron_gspo.convert.hf_io import HFCheckpointReader

    make_family_model(arch, tmp_path / "hf")
    moe = bool(FAMILIES[arch][1].get("n_routed_experts") or
               FAMILIES[arch][1].get("num_local_experts"))
    cli = [sys.executable, "-W", "ignore", str(ROOT / "tools" / "convert_checkpoint.py")]
    layout = ["--tp", "2"] + (["--ep", "2"] if moe else [])
    for argv in (["hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck"),
                  *layout], ["mcore-to-hf", "--ckpt", str(tmp_path / "ck"), "--out",
                             str(tmp_path / "back")]):
        p = subprocess.run([*cli, *argv, "--no-progress"], capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
    got = {}
    for f in (tmp_path / "back").glob("*.safetensors"):
        got.update(load_file(f))
    ref = HFCheckpointReader(tmp_path / "hf")
    assert sorted(got) == sorted(ref.keys())
    assert all(got[k].dtype == ref.get(k).dtype and torch.equal(got[k], ref.get(k)) for k in got)
