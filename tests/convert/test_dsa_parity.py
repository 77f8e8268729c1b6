"""DeepSeek Sparse Attention (issue 55, item 4): DeepSeek-V3.2 and GLM-5 on Megatron-Core 0.19's
PyTorch DSA path (`experimental_attention_variant/dsa.py`: `fused_qk_topk_naive` top-k,
`_unfused_absorbed_dsa_fn` sparse attention), on tiny random models shaped like the released
configs (tests/convert/tiny_dsa.py): logits equal transformers' within 1e-5 (fp32) in one process
and under PP2 / EP2, the exported HF tensors equal the originals bit for bit, an EP2 checkpoint
loads into one process with the same logits. The tiny models' indexers keep 4 of 12 tokens: the
same weights with every token kept (dense MLA) give logits > 1e-3 away, so the comparison covers
the indexer's choice. On megatron-core 0.16.1 (no dsa.py) the same models are refused in one line.
The numbers are printed (`pytest -s`).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.megatron.compat import version
from tests.convert.test_family_parity import TOL, _launch
from tests.convert.tiny_dsa import DSA_FAMILIES, dense_logits, make_dsa_model

HAS_DSA = version() >= (0, 19, 0)


def _hf_config(arch: str, tmp_path) -> dict:
    import json

    model = make_dsa_model(arch, tmp_path / "hf")
    del model
    return json.loads((tmp_path / "hf" / "config.json").read_text())


def _refs(arch, tmp_path) -> float:
    """Save the reference logits of the tiny model; returns max |sparse - dense| logits."""
    model = make_dsa_model(arch, tmp_path / "hf")
    tokens = torch.randint(0, model.config.vocab_size, (2, 12),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
    torch.save({"tokens": tokens, "logits": logits}, tmp_path / "refs.pt")
    return float((logits - dense_logits(model, tokens)).abs().max())


def _refused_without_dsa(arch, tmp_path) -> None:
    """megatron-core 0.16.1: one line at config time naming the release and the upstream line
    (its indexer's unconditional Hadamard rotation: bf16 and a CUDA package), still there."""
    from pathlib import Path

    import megatron.core

    from megatron_gspo.megatron.models.builder import ModelConfigError, build_model_config
    from megatron_gspo.megatron.models.deepseek_v32 import ROTATION_LINE

    with pytest.raises(ModelConfigError, match=r"needs megatron-core >= 0\.19: the installed "
                       r"megatron-core 0\.16\.\d+'s DSA indexer rotates") as e:
        build_model_config(_hf_config(arch, tmp_path), use_te=False)
    assert "\n" not in str(e.value) and "fast_hadamard_transform" in str(e.value)
    src = Path(megatron.core.__file__).parent / "transformer/experimental_attention_variant/dsa.py"
    assert src.read_text().splitlines()[590].strip() == ROTATION_LINE


@pytest.mark.parametrize("arch", sorted(DSA_FAMILIES))
def test_dsa_single_process_logits_match_transformers(arch, tmp_path):
    if not HAS_DSA:
        return _refused_without_dsa(arch, tmp_path)
    control = _refs(arch, tmp_path)
    errs = _launch(tmp_path, tmp_path / "hf", 1, ["single"], "one")
    print(f"\n{arch}: max |logits - transformers| {errs}; sparse vs dense MLA {control:.3g}")
    assert control > 1e-3
    assert errs["single"] <= TOL, errs


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(DSA_FAMILIES))
def test_dsa_pp2_ep2_logits_match_transformers(arch, tmp_path):
    if not HAS_DSA:
        return _refused_without_dsa(arch, tmp_path)
    _refs(arch, tmp_path)
    errs = _launch(tmp_path, tmp_path / "hf", 2, ["pp2", "ep2"], "multi")
    errs.update(_launch(tmp_path, tmp_path / "hf", 1, ["single"], "one"))
    print(f"\n{arch}: max |logits - transformers| per layout: {errs}")
    want = {"single", "pp2", "ep2", "single_from_ep2_ckpt"}
    assert want <= set(errs), errs
    errs.pop("bucket_groups", None)
    assert all(v <= TOL for v in errs.values()), errs


def test_dsa_refusals_are_one_line(tmp_path):
    """TP > 1 (not measured), the Transformer Engine spec (none for DSA here), a GLM-5 top-k
    sharing pattern Megatron-Core cannot express, and a missing indexer field: one line each."""
    from megatron_gspo.megatron.models.builder import ModelConfigError, build_model_config
    from megatron_gspo.megatron.parallel import ParallelLayout, ParallelLayoutError, check_layout

    cfg = _hf_config("GlmMoeDsaForCausalLM", tmp_path)
    with pytest.raises(ParallelLayoutError, match="parallel.tensor > 1 is not supported yet"):
        check_layout(ParallelLayout(tensor=2, sequence_parallel=True), 2, cfg)
    cases = {
        "use_te": ({}, True, "local spec only"),
        "pattern": ({"indexer_types": ["full", "shared", "full", "full"]}, False,
                    "not a pattern Megatron-Core" if HAS_DSA else "megatron-core >= 0.19"),
        "missing": ({"index_topk": None}, False, "missing required field 'index_topk'"
                    if HAS_DSA else "megatron-core >= 0.19"),
        "rope": ({"indexer_rope_interleave": False}, False, "indexer_rope_interleave=false"),
    }
    for name, (change, use_te, line) in cases.items():
        with pytest.raises(ModelConfigError) as e:
            build_model_config({**cfg, **change}, use_te=use_te)
        assert line in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
