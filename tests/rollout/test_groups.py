"""Group sampling: groups kept together, over-sampling, zero-variance groups dropped."""

from __future__ import annotations

import itertools

import pytest

from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
from megatron_gspo.rollout.groups import GroupSampler, has_zero_variance, split_groups


def _prompts():
    for i in itertools.count():
        yield GenerateRequest([2 + i % 50, 3, 4], prompt=f"p{i}")


def test_groups_kept_together_and_zero_variance_dropped(engine):
    calls = []

    def score(samples):  # prompts p0, p3, p6, ... always score 1 -> zero variance
        calls.append(len(samples))
        for s in samples:
            i = int(s.prompt[1:])
            s.reward = 1.0 if i % 3 == 0 else float(s.response_ids[0] % 2 + s.index % 2)

    sampler = GroupSampler(engine, group_size=4, score=score, oversample_factor=1.5,
                           drop_zero_variance=True,
                           sampling=SamplingParams(max_new_tokens=3, temperature=1.0))
    samples, m = sampler.collect(_prompts(), num_groups=4)
    assert len(samples) == 16 and m["groups_kept"] == 4 and m["groups_short"] == 0
    groups = split_groups(samples)
    assert [g[0].group_index for g in groups] == [0, 1, 2, 3]
    assert all(len(g) == 4 and len({s.prompt for s in g}) == 1 for g in groups)
    assert all(not has_zero_variance(g) for g in groups)
    assert [s.index for s in samples] == list(range(16))
    assert all(int(g[0].prompt[1:]) % 3 != 0 for g in groups)
    assert m["groups_zero_variance"] >= 2 and calls[0] == 6 * 4  # ceil(4 * 1.5) prompts
    assert m["groups_generated"] == m["groups_kept"] + m["groups_zero_variance"] + m[
        "groups_surplus"]
    assert m["zero_variance_share"] == m["groups_zero_variance"] / m["groups_generated"]


def test_prompts_run_out_and_bad_settings(engine):
    def score(samples):
        for s in samples:
            s.reward = 0.0

    sampler = GroupSampler(engine, 2, score, drop_zero_variance=True,
                           sampling=SamplingParams(max_new_tokens=2))
    few = iter([GenerateRequest([5, 6]), GenerateRequest([7, 8])])
    samples, m = sampler.collect(few, num_groups=3)
    assert samples == [] and m["groups_short"] == 3 and m["groups_zero_variance"] == 2
    with pytest.raises(ValueError, match="oversample_factor"):
        GroupSampler(engine, 2, score, oversample_factor=0.5)
    with pytest.raises(ValueError, match="no reward"):
        has_zero_variance(engine.generate([GenerateRequest([1, 2], SamplingParams(
            max_new_tokens=1))]))
