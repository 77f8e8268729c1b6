"""SGLang 0.5.12's real CPU server (tier `sglang_real`) on the tiny models of the families beyond
Llama / Qwen that it serves on CPU (tests/convert/tiny_families.py): served log-probs against
transformers' recompute, and a tensor weight sync under the family's export names (its
StateDictAdapter's HF names, as the learner exports them) verified by the sync probe. One server
at a time. Gemma 3: sequences within the sliding window only (the CPU attention backend has no
sliding window); DeepSeek-V3 and gpt-oss do not start on CPU (docs/model-families.md)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.rollout import _sglang_real as tier

tier.require_tier()
pytestmark = pytest.mark.sglang_real

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams  # noqa: E402
from megatron_gspo.rollout.sglang.client import SGLangEngine  # noqa: E402
from megatron_gspo.rollout.sglang.weight_sync_endpoints import (  # noqa: E402
    PROBE_PROMPT,
    PROBE_TOKENS,
    PROBE_TOLERANCE,
    check_sync_probe,
)

TOL = PROBE_TOLERANCE["float32"]
#: prompts, response length and probe (prompt, tokens) per family; Gemma 3's tiny model has a
#: sliding window of 5 tokens, so its sequences stay within 5
CASES = {
    "Glm4MoeForCausalLM": ([[5, 9, 12, 7], [20, 21, 22], [40, 3, 3, 17, 60, 61, 62], [8]], 8,
                           (PROBE_PROMPT, PROBE_TOKENS)),
    "Gemma3ForCausalLM": ([[5, 9], [20, 21], [40, 3], [8, 77]], 3, ((3, 5), 3)),
}


def _model_dir(arch, d):
    from tests.convert.tiny_families import make_family_model

    make_family_model(arch, d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tier.TINY / f, d / f)
    return d


def _export_named(d, seed):
    """(HF name, tensor) in the family adapter's order (the learner's export names), from the
    checkpoint of `d` with seeded noise added (a 'new version')."""
    from safetensors.torch import load_file

    from megatron_gspo.convert import get_adapter

    from megatron_gspo.convert.mtp import with_present_mtp_layers

    ckpt = load_file(str(d / "model.safetensors"))
    # transformers declares MTP layers (num_nextn_predict_layers) but writes none
    cfg = with_present_mtp_layers(json.loads((d / "config.json").read_text()), ckpt)
    adapter = get_adapter(cfg)
    names = list(adapter.hf_names(adapter.dims(cfg)))
    assert set(names) == set(ckpt), set(names) ^ set(ckpt)
    g = torch.Generator().manual_seed(seed)
    return [(n, (ckpt[n] + 0.05 * torch.randn(ckpt[n].shape, generator=g)).contiguous())
            for n in names]


def _saved(d, named, out):
    from safetensors.torch import save_file

    shutil.copytree(d, out)
    save_file(dict(named), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", sorted(CASES))
def test_family_served_logprobs_and_tensor_sync(arch, tmp_path):
    prompts, new, (probe_prompt, probe_tokens) = CASES[arch]
    d = _model_dir(arch, tmp_path / "base")
    eng = SGLangEngine(launch=tier.spec(d, "float32", tier.API_KEY, str(tmp_path / "logs")),
                       startup_timeout_s=900, request_timeout_s=120, vocab_size=160,
                       backoff_s=0.05)
    try:
        eng.sync(eng.astart())
        sp = SamplingParams(max_new_tokens=new, temperature=0.7, n=4, ignore_eos=True)
        samples = eng.generate([GenerateRequest(p, sp) for p in prompts])
        assert all(len(s.response_ids) == new for s in samples)
        mine = tier.recompute(tier.hf_model(d), [(s.prompt_ids, s.response_ids)
                                                 for s in samples], 0.7)
        diffs = [abs(a - b) for s, m in zip(samples, mine, strict=True)
                 for a, b in zip(s.rollout_logprobs, m, strict=True)]
        print(f"\n{arch}: served vs recompute over {len(diffs)} tokens: max {max(diffs):.3g} "
              f"mean {sum(diffs) / len(diffs):.3g}")
        assert max(diffs) < TOL

        named = _export_named(d, seed=1)
        buckets = [named[i:i + 24] for i in range(0, len(named), 24)]
        eng.update_weights(buckets, version=1)  # CPU payloads (weight_sync)
        probes = eng.sync(eng.aprobe_servers(1.0, probe_prompt, probe_tokens))
        pairs = [(probe_prompt, ids) for _, ids, _ in probes]
        new_net = tier.hf_model(_saved(d, named, tmp_path / "v1"))
        err = check_sync_probe(1, probes, tier.recompute(new_net, pairs), TOL)
        print(f"{arch}: {len(named)} tensors in {len(buckets)} buckets; probe max diff "
              f"{err:.3g}")
        with pytest.raises(RolloutError, match="version 1 not verified"):  # versions differ
            check_sync_probe(1, probes, tier.recompute(tier.hf_model(d), pairs), TOL)
    finally:
        eng.shutdown()
    assert all(not p.alive() for p in eng.procs)
