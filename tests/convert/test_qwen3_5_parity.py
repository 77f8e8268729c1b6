"""Qwen3.5 dense (Qwen3_5ForCausalLM) and MoE (Qwen3_5MoeForCausalLM): Megatron-Core logits
equal transformers' in one process, TP2 (+SP), PP2, EP2 (fp32, <= 1e-5) on tiny random models
(tests/convert/tiny_qwen3_5.py) over 70 tokens (two chunks of the chunked delta rule); the
exported HF tensors equal the originals bit for bit (tests/convert/_parity_worker.py); the
conversion round-trips bit-exact; a released-style vision-language checkpoint (fused experts,
vision tower, MTP) becomes the text checkpoint bit for bit, and is refused in one line as it
stands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.convert.test_qwen3_next_parity import PACKED, ROOT, TOL, _launch
from tests.convert.tiny_qwen3_5 import (
    DENSE,
    MOE,
    QWEN3_5,
    make_qwen3_5,
    make_released_qwen3_5_moe,
    text_fields,
)

KINDS = {"dense": False, "moe": True}
SINGLE = {"dense": (False, {}), "dense_tied": (False, {"tie_word_embeddings": True}),
          "moe": (True, {})}  # dense_tied: one embedding for input and output


def _refs(tmp, moe: bool, **changes) -> None:
    model = make_qwen3_5(tmp / "hf", moe, **changes)
    tokens = torch.randint(0, QWEN3_5["vocab_size"], (2, 70),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.save({"tokens": tokens, "logits": model(tokens).logits}, tmp / "refs.pt")


@pytest.mark.parametrize("kind", sorted(SINGLE))
def test_single_process_logits_match_transformers(tmp_path, kind):
    _refs(tmp_path, SINGLE[kind][0], **SINGLE[kind][1])
    errs = _launch(tmp_path, 1, ["single"], "one")
    print(f"\nQwen3.5 {kind} max |logits - transformers|: {errs}")
    assert errs["single"] <= TOL, errs


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_tp2_pp2_ep2_logits_match_transformers(tmp_path, kind):
    """TP2 (+SP for MoE; the delta-net's in_proj / conv1d split per section), PP2 and EP2
    (MoE; 2 ranks, export bit-exact, per stage under PP2), then the TP2 / EP2 checkpoints
    loaded in one process."""
    moe = KINDS[kind]
    _refs(tmp_path, moe)
    errs = _launch(tmp_path, 2, ["tp2", "pp2", "ep2"], "multi")
    errs.update(_launch(tmp_path, 1, ["single"], "one"))
    print(f"\nQwen3.5 {kind} max |logits - transformers| per layout: {errs}")
    want = {"tp2", "pp2", "single", "single_from_tp2_ckpt"}
    assert set(errs) == (want | {"ep2", "single_from_ep2_ckpt"} if moe else want), errs
    assert max(errs.values()) <= TOL, errs


def test_packed_rows_match_transformers_per_sequence(tmp_path):
    """Qwen3.5-MoE on the learner's packed rows (THD, Qwen3-Next's worker): no delta-net state
    crosses a sequence boundary."""
    model = make_qwen3_5(tmp_path / "hf", True)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, QWEN3_5["vocab_size"], (n,), generator=g) for n in (30, 45)]
    with torch.no_grad():
        logits = [model(s.unsqueeze(0)).logits[0] for s in seqs]
    torch.save({"seqs": seqs, "logits": logits}, tmp_path / "packed_refs.pt")
    out = tmp_path / "packed.json"
    p = subprocess.run([sys.executable, "-W", "ignore", str(PACKED), str(tmp_path / "hf"),
                        str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    errs = json.loads(out.read_text())["errors"]
    print(f"\npacked Qwen3.5-MoE, max |logits - transformers| per sequence: {errs}")
    assert max(errs) <= TOL, errs


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_layouts_round_trip_bit_exact(tmp_path, kind):
    from safetensors.torch import load_file

    from megatron_gspo.convert import get_adapter

    make_qwen3_5(tmp_path, KINDS[kind])
    cfg = json.loads((tmp_path / "config.json").read_text())
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    assert dims.linear == (True, True, True, False)
    assert dims.moe == (KINDS[kind],) * 4
    sd = load_file(tmp_path / "model.safetensors")
    assert sorted(adapter.hf_names(dims)) == sorted(sd)
    mc = adapter.hf_to_mcore(sd.__getitem__, dims, padded_vocab=256)
    # Megatron's in_proj = [q; k; v; z; b; a]: HF's flat in_proj_qkv, then z, b, a
    a = "model.layers.0.linear_attn."
    inp = mc["decoder.layers.0.self_attention.in_proj.weight"]  # [2*16 + 32 + 32 + 4 + 4, 64]
    assert torch.equal(inp, torch.cat([sd[a + f"in_proj_{x}.weight"] for x in "qkv z b a".split()]))
    back = adapter.mcore_to_hf(mc, dims)
    assert sorted(back) == sorted(sd)
    assert all(torch.equal(back[n], sd[n]) for n in sd)


def test_released_checkpoint_becomes_the_text_checkpoint(tmp_path):
    """Qwen3_5MoeForConditionalGeneration as released (``model.language_model.*``, fused
    experts, vision tower, MTP): refused in one line by the converter and the builder; the text
    checkpoint written from it holds its text weights bit for bit, and transformers'
    Qwen3_5MoeForCausalLM on it gives the vision-language model's text-only logits exactly."""
    import transformers

    from megatron_gspo.convert import ConversionError, get_adapter
    from megatron_gspo.convert.qwen3_5 import main
    from megatron_gspo.megatron.models.builder import ModelConfigError, build_model_config

    vl = make_released_qwen3_5_moe(tmp_path / "vl")
    cfg = json.loads((tmp_path / "vl" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    for call, err in ((lambda: get_adapter(cfg).dims(cfg), ConversionError),
                      (lambda: build_model_config(cfg, use_te=False), ModelConfigError)):
        with pytest.raises(err) as e:
            call()
        assert "vision-language" in str(e.value) and "\n" not in str(e.value), e.value
    assert main([str(tmp_path / "vl"), str(tmp_path / "text")]) == 0
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    assert text["architectures"] == [MOE] and text["model_type"] == "qwen3_5_moe_text"
    model = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "text").eval()
    want = {k.replace("model.language_model.", "model."): v
            for k, v in vl.state_dict().items() if not k.startswith("model.visual.")}
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    tokens = torch.randint(0, QWEN3_5["vocab_size"], (2, 40),
                           generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, vl(input_ids=tokens).logits)
    from megatron_gspo.convert.hf_io import HFCheckpointReader, validate_hf_checkpoint
    from megatron_gspo.convert.qwen3_5 import text_only_checkpoint

    adapter = get_adapter(text)  # and the learner's converter takes it, in small shards too
    counts = text_only_checkpoint(tmp_path / "vl", tmp_path / "shards", max_shard_bytes=1 << 16)
    one, many = HFCheckpointReader(tmp_path / "text"), HFCheckpointReader(tmp_path / "shards")
    assert counts == {"kept": len(one.keys()), "vision": 21, "mtp": 1}, counts
    assert sorted(many.keys()) == sorted(one.keys())
    assert all(torch.equal(many.get(k), one.get(k)) for k in one.keys())
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1
    for reader in (one, many):
        validate_hf_checkpoint(reader, adapter, adapter.dims(text))


@pytest.mark.parametrize("arch,change,message", [
    (DENSE, {"num_experts": 4}, "num_experts"),
    (MOE, {"norm_topk_prob": False}, "norm_topk_prob"),
    (MOE, {"mlp_only_layers": [1]}, "mlp_only_layers"),
    (DENSE, {"linear_num_key_heads": None}, "linear_num_key_heads"),
])
def test_config_refusals_are_one_line(arch, change, message):
    from megatron_gspo.megatron.models.builder import ModelConfigError, build_model_config

    cfg = {**text_fields(arch == MOE), **change, "architectures": [arch]}
    with pytest.raises(ModelConfigError, match=message) as e:
        build_model_config(cfg, use_te=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_exported_names_are_known_to_sglang(kind):
    """Every module / parameter name the exporter sends occurs in SGLang's Qwen3.5 model source
    (0.5.12 and, where installed, 0.5.23: models/qwen3_5.py, the file its
    Qwen3_5(Moe)ForConditionalGeneration entry classes live in, and qwen2_moe.py); their
    loaders map ``model.language_model.`` to ``model.``, so the text names load as sent."""
    from megatron_gspo.convert import get_adapter
    from tests.convert.test_sglang_names import ROOT, _sglang_models

    sources = [m for m in (
        _sglang_models(), *sorted(ROOT.glob(".sglang-cpu-0.5.23/venv/lib/python3*/"
                                            "site-packages/sglang/srt/models")))
        if m is not None and (m / "qwen3_5.py").is_file()]
    if not sources:
        pytest.skip("no SGLang source with models/qwen3_5.py is installed")
    cfg = {**text_fields(KINDS[kind]), "architectures": [MOE if KINDS[kind] else DENSE]}
    adapter = get_adapter(cfg)
    parts = set()
    for n in adapter.hf_names(adapter.dims(cfg)):
        pieces = n.split(".")
        pieces = pieces[:-1] if pieces[-1] in ("weight", "bias") else pieces
        parts.update(p for p in pieces[-2:] if not p.isdigit() and p != "model")
    for src in sources:  # (its MoE block is Qwen2MoeSparseMoeBlock, from qwen2_moe.py)
        text = "\n".join((src / f).read_text() for f in ("qwen3_5.py", "qwen2_moe.py"))
        missing = sorted(p for p in parts if not re.search(rf"\b{re.escape(p)}\b", text))
        assert not missing, f"names {src} never mentions: {missing}"


@pytest.mark.parametrize("name", ["Qwen3_5MoeConfig", "Qwen3_5Config"])
def test_full_size_released_configs_build(name):
    """transformers' default Qwen3.5 vision-language configs (the MoE one is Qwen3.5-35B-A3B's
    shape) -> `text_config` -> adapter dims and TransformerConfig, no weights."""
    import transformers

    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.qwen3_5 import text_config
    from megatron_gspo.megatron.models.builder import build_model_config

    vl = getattr(transformers, name)().to_dict()
    vl["architectures"] = [name.replace("Config", "ForConditionalGeneration")]
    cfg = text_config(vl)
    dims = get_adapter(cfg).dims(cfg)
    config = build_model_config(cfg, use_te=False)
    n = cfg["num_hidden_layers"]
    assert dims.linear == tuple((i + 1) % 4 != 0 for i in range(n))
    assert config.linear_attention_freq == [int(x) for x in dims.linear]
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 32)
    if name == "Qwen3_5MoeConfig":
        assert all(dims.moe) and dims.num_experts == 256
        assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size,
                config.moe_shared_expert_intermediate_size) == (256, 8, 512, 512)
        assert config.moe_router_pre_softmax is False  # top-k renormalised
    else:
        assert not any(dims.moe) and config.num_moe_experts is None
        assert config.ffn_hidden_size == cfg["intermediate_size"] == 12288


@pytest.mark.slow
@pytest.mark.parametrize("arch", [MOE, "Qwen3NextForCausalLM"])
def test_cli_round_trip_tp2_ep2_to_pp2_bit_exact(tmp_path, arch):
    """`megatron-gspo convert hf-to-mcore --tp 2 --ep 2`, then `mcore-to-hf --pp 2`: the HF
    tensors come back bit for bit (the checkpoint guard counts the gated attention's [q; gate]
    rows of linear_qkv)."""
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from tests.convert.tiny_qwen3_next import make_qwen3_next

    hf, mc, back = tmp_path / "hf", tmp_path / "mc", tmp_path / "back"
    make_qwen3_5(hf, True) if arch == MOE else make_qwen3_next(hf)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for argv in (["hf-to-mcore", "--hf", str(hf), "--out", str(mc), "--tp", "2", "--ep", "2"],
                 ["mcore-to-hf", "--ckpt", str(mc), "--out", str(back), "--pp", "2"]):
        p = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "convert", *argv,
                            "--no-progress"], capture_output=True, text=True, timeout=900,
                           cwd=ROOT, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
    a, b = HFCheckpointReader(hf), HFCheckpointReader(back)
    assert sorted(a.keys()) == sorted(b.keys())
    assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
