"""Embedded engine: log-probs equal a full forward pass, sampling controls, weight loading."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
from megatron_gspo.rollout.embedded import EmbeddedEngine, filter_logits, sequence_logprobs


def _requests():
    return [
        GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=12, temperature=0.7, n=3)),
        GenerateRequest([9] * 9, SamplingParams(max_new_tokens=9, temperature=1.4, top_p=0.8,
                                                top_k=20, n=2, stop_token_ids=(3, 4))),
        GenerateRequest([11, 12], SamplingParams(max_new_tokens=6, temperature=0.0)),
    ]


def test_logprobs_match_full_forward_fp32(engine):
    reqs = _requests()
    samples = engine.generate(reqs)
    assert [s.group_index for s in samples] == [0, 0, 0, 1, 1, 2]
    assert [s.index for s in samples] == list(range(6))
    for s in samples:
        sp = reqs[s.group_index].sampling
        assert s.prompt_ids == reqs[s.group_index].prompt_ids
        ref = sequence_logprobs(engine.model, s.prompt_ids, s.response_ids, sp.temperature)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), ref, atol=1e-5, rtol=0)
        assert len(s.response_ids) <= sp.max_new_tokens
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in set(sp.stop_token_ids) | {1}
        else:
            assert len(s.response_ids) == sp.max_new_tokens


def test_logprob_is_temperature_scaled_not_truncated(engine):
    """Log-probs come from softmax(logits / T) over the full vocab, not the top-k/p renorm."""
    sp = SamplingParams(max_new_tokens=5, temperature=2.0, top_k=3, ignore_eos=True)
    s = engine.generate([GenerateRequest([2, 3, 4], sp)])[0]
    at_t = sequence_logprobs(engine.model, s.prompt_ids, s.response_ids, 2.0)
    at_1 = sequence_logprobs(engine.model, s.prompt_ids, s.response_ids, 1.0)
    got = torch.tensor(s.rollout_logprobs)
    torch.testing.assert_close(got, at_t, atol=1e-5, rtol=0)
    assert not torch.allclose(got, at_1, atol=1e-3)
    assert (got < -0.1).any()  # a top-3 renormalised log-prob would be close to 0 more often


def test_greedy_and_seeding(tiny_model_dir):
    a = EmbeddedEngine(tiny_model_dir, seed=7)
    b = EmbeddedEngine(tiny_model_dir, seed=7)
    c = EmbeddedEngine(tiny_model_dir, seed=8)
    req = [GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=16, n=4, ignore_eos=True))]
    ra, rb, rc = a.generate(req), b.generate(req), c.generate(req)
    assert [s.response_ids for s in ra] == [s.response_ids for s in rb]
    assert [s.response_ids for s in ra] != [s.response_ids for s in rc]
    g = SamplingParams(max_new_tokens=8, temperature=0.0, n=2, ignore_eos=True)
    ga = a.generate([GenerateRequest([3, 4, 5], g)])
    assert ga[0].response_ids == ga[1].response_ids
    ids = [3, 4, 5]
    for tok in ga[0].response_ids:  # greedy = argmax of a fresh forward
        logits = a.model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert int(logits.argmax()) == tok
        ids.append(tok)


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = filter_logits(logits, torch.tensor([0, 2]), torch.tensor([0.7, 1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).sum() == 2
    keep_first = filter_logits(logits, torch.tensor([0, 0]), torch.tensor([0.01, 0.01]))
    assert torch.isfinite(keep_first).sum(-1).tolist() == [1, 1]


def test_weight_update_changes_output_and_version(engine, tiny_config):
    from megatron_gspo.rollout.embedded import build_hf_model

    req = [GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                     ignore_eos=True))]
    before = engine.generate(req)[0]
    assert before.weight_version == 0
    torch.manual_seed(99)
    other = build_hf_model(tiny_config)
    named = list(other.state_dict().items())
    engine.update_weights([named[:3], named[3:]], version=5)
    assert engine.weight_version == 5
    after = engine.generate(req)[0]
    assert after.weight_version == 5
    assert after.response_ids != before.response_ids
    ref = sequence_logprobs(other, after.prompt_ids, after.response_ids, 1.0)
    torch.testing.assert_close(torch.tensor(after.rollout_logprobs), ref, atol=1e-5, rtol=0)


def test_weight_update_errors_name_the_tensor(engine):
    with pytest.raises(KeyError, match="model.nope"):
        engine.load_buckets([[("model.nope", torch.zeros(2))]], 1)
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.load_buckets([[("lm_head.weight", torch.zeros(2, 2))]], 1)
    assert engine.weight_version == 0


def test_bfloat16_and_limits(tiny_config):
    eng = EmbeddedEngine(tiny_config, dtype="bfloat16", max_model_len=20, max_batch_samples=3)
    out = eng.generate([GenerateRequest([1, 2] * 8, SamplingParams(max_new_tokens=50, n=5,
                                                                   ignore_eos=True))])
    assert len(out) == 5 and all(len(s.response_ids) == 4 for s in out)
    assert all(s.finish_reason == "length" for s in out)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.generate([GenerateRequest([1] * 20)])
    with pytest.raises(ValueError, match="dtype"):
        EmbeddedEngine(tiny_config, dtype="int8")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_release_resume_and_async(engine):
    import asyncio

    engine.release_memory()
    assert not engine.health()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate([GenerateRequest([1, 2])])
    engine.resume_memory()
    assert engine.health()
    out = asyncio.run(engine.agenerate([GenerateRequest([1, 2], SamplingParams(n=2,
                                                                              max_new_tokens=3))]))
    assert len(out) == 2
    engine.shutdown()


def test_config_dict_of_a_model_without_sdpa_builds_eager(tmp_path):
    """The training loop builds the engine from the HF config dict: gpt-oss (attention sinks,
    no SDPA path in transformers) falls back to eager attention as from a directory."""
    import json

    from tests.convert.tiny_families import make_family_model

    make_family_model("GptOssForCausalLM", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    eng = EmbeddedEngine(cfg, seed=0)
    assert eng.model.config._attn_implementation == "eager"
    out = eng.generate([GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=3,
                                                                  ignore_eos=True))])
    assert len(out[0].response_ids) == 3
