"""Reward extraction, comparison, registry and the Sample batch helper."""

import sys
import textwrap

import pytest

from megatron_gspo.data.sample import Sample
from megatron_gspo.rewards import RewardError, get_reward_fn, registered_rewards, score_samples
from megatron_gspo.rewards.math import extract_boxed, extract_last_number, parse_number


@pytest.mark.parametrize("text,expected", [
    (r"so the answer is \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{3}{4}}", r"\frac{3}{4}"),
    (r"\boxed{x^{2}+1}", "x^{2}+1"),
    (r"\boxed{12", None),
    ("no box here", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("I think 3 then 1,234.5 apples", "1,234.5"),
    ("it is -7.", "-7"),
    ("nothing", None),
])
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


@pytest.mark.parametrize("s,value", [
    ("1,234", 1234.0), ("-2.5", -2.5), ("3/4", 0.75), (r"\frac{1}{8}", 0.125),
    (r"\dfrac{6}{3}", 2.0), ("50\\%", 50.0), ("$12$", 12.0), ("abc", None), ("1/0", None),
])
def test_parse_number(s, value):
    assert parse_number(s) == value


@pytest.mark.parametrize("response,label,reward", [
    ("95", "95", 1.0),
    ("The sum is 95.", 95, 1.0),
    (r"first 10, finally \boxed{0.5}", "1/2", 1.0),
    (r"\boxed{95} but later 3", "95", 1.0),          # box wins over last number
    ("94", "95", 0.0),
    ("", "95", 0.0),
    ("1,000", "Step... #### 1000", 1.0),            # GSM8K-style label
    (r"\boxed{\text{Paris}}", "paris", 1.0),        # non-numeric string compare
    ("0.333", "1/3", 0.0),
    ("95.0000000001", "95", 1.0),                   # within tolerance
])
def test_math_reward(response, label, reward):
    assert get_reward_fn("math")(response, label, {}) == reward


def test_reward_kwargs():
    assert get_reward_fn("math")("0.333", "1/3", {}, rel_tol=1e-2) == 1.0
    assert get_reward_fn("exact_match")("Paris", "paris", {}, case_sensitive=True) == 0.0
    s = [_sample(0, [3], "3.1")]
    assert score_samples(s, get_reward_fn("math"), str, {"abs_tol": 0.2}) == [1.0]


def test_math_boxed_strict_needs_box():
    fn = get_reward_fn("math_boxed_strict")
    assert fn("the answer is 7", "7", {}) == 0.0
    assert fn(r"\boxed{7}", "7", {}) == 1.0


def test_exact_match():
    fn = get_reward_fn("exact_match")
    assert fn("  Hello   World. ", "hello world", {}) == 1.0
    assert fn("hello", ["hi", "Hello"], {}) == 1.0
    assert fn("hello there", "hello", {}) == 0.0


def test_unknown_name_lists_registered():
    with pytest.raises(RewardError) as e:
        get_reward_fn("maths")
    for name in ("math", "exact_match", "math_boxed_strict"):
        assert name in str(e.value)
    assert set(registered_rewards()) >= {"math", "exact_match", "math_boxed_strict"}


def test_module_function_loading(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length_reward(response_text, label, sample_metadata):
            return float(len(response_text)) + sample_metadata.get("bonus", 0)

        def bad_signature(text):
            return 0.0

        not_callable = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("my_rewards:length_reward")
    assert fn("abc", None, {"bonus": 1}) == 4.0
    # path form
    assert get_reward_fn(f"{tmp_path / 'my_rewards.py'}:length_reward")("ab", None, {}) == 2.0
    with pytest.raises(RewardError, match="no attribute 'nope'"):
        get_reward_fn("my_rewards:nope")
    with pytest.raises(RewardError, match="not callable"):
        get_reward_fn("my_rewards:not_callable")
    with pytest.raises(RewardError, match="must accept"):
        get_reward_fn("my_rewards:bad_signature")
    with pytest.raises(RewardError, match="cannot import module 'no_such_module_xyz'"):
        get_reward_fn("no_such_module_xyz:f")
    sys.modules.pop("my_rewards", None)


def _sample(i, response, label, **meta):
    return Sample(prompt_ids=[1, 2], response_ids=response, index=i, label=label,
                  prompt="p", metadata=meta)


def test_score_samples_sets_rewards_and_passes_metadata():
    detok = lambda ids: "".join(str(t) for t in ids)  # noqa: E731
    samples = [_sample(0, [9, 5], "95"), _sample(1, [9, 4], "95"), _sample(2, [1], "1", k=7)]
    seen = []

    def fn(text, label, meta):
        seen.append(meta)
        return get_reward_fn("math")(text, label, meta)

    assert score_samples(samples, fn, detok) == [1.0, 0.0, 1.0]
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert seen[2]["k"] == 7 and seen[2]["prompt"] == "p" and seen[2]["finish_reason"] == "stop"
    assert seen[1]["index"] == 1


def test_score_samples_bad_values():
    s = [_sample(3, [1], "1")]
    with pytest.raises(RewardError, match="sample 3.*ZeroDivisionError"):
        score_samples(s, lambda t, lab, m: 1 / 0, str)
    with pytest.raises(RewardError, match="returned nan"):
        score_samples(s, lambda t, lab, m: float("nan"), str)
    with pytest.raises(RewardError, match="returned str"):
        score_samples(s, lambda t, lab, m: "high", str)


def test_a_reward_failing_on_one_sample_fails_that_sample_only():
    """In the trainer (mark_failed=True) a reward that raises, or returns a non-number or NaN,
    on one sample marks that sample failed (its group is then dropped and counted) instead of
    ending the run; the others are scored as usual."""
    samples = [_sample(i, [1], lab) for i, lab in enumerate(["ok", "raise", "nan", "str", "ok"])]

    def fn(text, label, meta):
        if label == "raise":
            raise ZeroDivisionError("division by zero\nin a user reward")
        return {"ok": 1.0, "nan": float("nan"), "str": "high"}[label]

    assert score_samples(samples, fn, str, mark_failed=True) == [1.0, 0.0, 0.0, 0.0, 1.0]
    errors = [s.metadata.get("rollout_error") for s in samples]
    assert errors[0] is None and errors[4] is None
    assert "sample 1" in errors[1] and "ZeroDivisionError" in errors[1]
    assert "returned nan for sample 2" in errors[2]
    assert "returned str" in errors[3] and "sample 3" in errors[3]
    assert all("\n" not in e for e in errors[1:4])
    with pytest.raises(RewardError, match="sample 1"):  # the default still raises
        score_samples(samples, fn, str)


def test_group_sampling_drops_the_group_of_a_failed_reward_and_goes_on():
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
    from megatron_gspo.rollout.groups import GroupSampler

    class Echo:
        """Answers every request with its label as the response token."""

        default_sampling = SamplingParams()

        def generate(self, requests):
            return [Sample(prompt_ids=[1], response_ids=[int(r.label)], loss_mask=[1],
                           index=i, group_index=r.group_index, label=r.label)
                    for i, r in enumerate(requests)]

    def fn(text, label, meta):
        if label == "7":
            raise ValueError("cannot parse the label")
        return float(len(text))

    sampler = GroupSampler(Echo(), group_size=1, score=lambda ss: score_samples(
        ss, fn, lambda ids: "x" * ids[0], mark_failed=True))
    prompts = iter([GenerateRequest(prompt_ids=[1], label=str(v)) for v in (1, 7, 2, 3)])
    out, m = sampler.collect(prompts, 3)
    assert [s.label for s in out] == ["1", "2", "3"]
    assert m["groups_failed"] == 1 and m["samples_failed"] == 1


@pytest.mark.parametrize("value", [1e300, -1e300, 1e38])
def test_rewards_too_large_for_float32_advantages_are_refused(value):
    """Finite rewards whose group statistics overflow float32 (1e300; four of 1e38 in a
    group) would give NaN advantages; the reward is refused, naming the sample."""
    from megatron_gspo.algo.advantages import group_advantages

    samples = [Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], index=i,
                      group_index=0) for i in range(4)]
    with pytest.raises(RewardError, match=r"sample 0.*outside \[-1e\+15, 1e\+15\]"):
        score_samples(samples, lambda t, lab, m: value, lambda ids: "x")
    rewards = score_samples(samples, lambda t, lab, m: value, lambda ids: "x", mark_failed=True)
    assert rewards == [0.0] * 4
    assert all("sample" in s.metadata["rollout_error"] for s in samples)
    big = [1e15, -1e15, 1e15, 0.0]  # the bound itself stays finite through the advantages
    import torch
    assert torch.isfinite(group_advantages(torch.tensor(big), 4)).all()


@pytest.mark.parametrize("response,label,reward", [
    ("8 + 21", 29, 0.0),  # the question restated: math-verify alone evaluates it to 29
    ("54 + 9<|im_end|>", 63, 0.0),
    ("The sum 8 + 21 equals the answer", 29, 0.0),
    (r"\boxed{8+21}", 29, 0.0),
    (r"\boxed{2 \times 3}", 6, 0.0),
    ("8 + 21 = 29", 29, 1.0),
    ("8 + 21 is 29.", 29, 1.0),
    (r"\boxed{3/4}", 0.75, 1.0),  # a fraction is a value
    ("2 + 3", "2 + 3", 1.0),  # a label that is an expression compares as before
])
def test_math_reward_does_not_count_restated_arithmetic(response, label, reward):
    from megatron_gspo.rewards.math import math_boxed_strict_reward, math_reward

    assert math_reward(response, label) == reward
    if response.startswith("\\boxed"):
        assert math_boxed_strict_reward(response, label) == reward
