"""Conversion under TP / PP / EP with real Megatron-Core on CPU (gloo, 4 local processes).

One worker launch (tests/convert/_convert_worker.py) checks, for all four architectures:
logits of the converted Megatron model == transformers' (fp32, 1e-4 relative) under TP1/PP1 and
TP2/PP2 (+EP2 for MoE); a checkpoint written under one layout loads under the other with the
same logits; exported buckets equal the HF tensors bit for bit and respect their bound.
Then the CLI converts checkpoints back (mcore-to-hf) and transformers loads the result.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megatron_gspo.convert.hf_io import INDEX_NAME, HFCheckpointReader
from tests.convert.tiny_models import ARCHS

ROOT = Path(__file__).resolve().parents[2]
CLI = str(ROOT / "tools" / "convert_checkpoint.py")


def _cli(*argv):
    p = subprocess.run(
        [sys.executable, "-W", "ignore", CLI, *argv, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def layout_run(tiny_hf, tmp_path_factory):
    work = tmp_path_factory.mktemp("layouts")
    refs = {}
    for arch in ARCHS:
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf[arch]).eval()
        tokens = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            refs[arch] = {"tokens": tokens, "logits": model(tokens).logits}
    torch.save(refs, work / "refs.pt")
    args = {
        "hf_dirs": {a: str(d) for a, d in tiny_hf.items()},
        "refs_path": str(work / "refs.pt"),
        "work": str(work),
    }
    p = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            str(Path(__file__).with_name("_convert_worker.py")),
            json.dumps(args),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    return p, work, refs


@pytest.mark.slow
def test_logits_and_cross_layout_loading(layout_run):
    p, work, _ = layout_run
    assert p.returncode == 0, p.stderr[-3000:]
    from torch.distributed.checkpoint import FileSystemReader

    for arch in ARCHS:
        assert (work / f"{arch}_A" / "megatron_gspo_checkpoint.json").is_file()
        assert (work / f"{arch}_B" / "hf_config" / "tokenizer_config.json").is_file()
        keys = set(FileSystemReader(str(work / f"{arch}_B")).read_metadata().state_dict_metadata)
        # pre-MLP norm keys follow the Transformer Engine spec (fused into fc1 unless MoE)
        fused = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
        separate = "decoder.layers.pre_mlp_layernorm.weight"
        moe = arch == "Qwen3MoeForCausalLM"
        assert (separate in keys, fused in keys) == ((True, False) if moe else (False, True))


def _assert_hf_dir_equal(out: Path, src: Path):
    index = json.loads((out / INDEX_NAME).read_text())
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_file(out / f))
    ref = HFCheckpointReader(src)
    assert sorted(got) == sorted(ref.keys())
    for k, v in got.items():
        r = ref.get(k)
        assert v.dtype == r.dtype and torch.equal(v, r), k
    assert (out / "config.json").read_text() == (src / "config.json").read_text()
    assert (out / "tokenizer_config.json").is_file()
    return got


@pytest.mark.slow
def test_mcore_to_hf_from_tp2_pp2_ep2_checkpoint(layout_run, tiny_hf, tmp_path):
    p, work, refs = layout_run
    assert p.returncode == 0, p.stderr[-3000:]
    arch = "Qwen3MoeForCausalLM"
    out = tmp_path / "hf"
    _cli(
        "mcore-to-hf",
        "--ckpt",
        str(work / f"{arch}_B"),
        "--out",
        str(out),
        "--max-shard-size",
        str(20_000 / 2**30),
    )
    assert len(list(out.glob("*.safetensors"))) > 3  # sharded
    got = _assert_hf_dir_equal(out, tiny_hf[arch])
    exported = torch.load(work / f"{arch}_export.pt")  # buckets of the TP2/PP2/EP2 export
    assert sorted(exported) == sorted(got)
    assert all(torch.equal(exported[k], got[k]) for k in got)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(refs[arch]["tokens"]).logits
    assert torch.equal(logits, refs[arch]["logits"])


@pytest.mark.slow
def test_cli_hf_to_mcore_to_hf_roundtrip(tiny_hf, tmp_path):
    arch = "Qwen2ForCausalLM"  # tied embeddings, qkv bias
    _cli("hf-to-mcore", "--hf", str(tiny_hf[arch]), "--out", str(tmp_path / "ck"))
    _cli("mcore-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"))
    _assert_hf_dir_equal(tmp_path / "hf", tiny_hf[arch])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
