"""Precision-tolerance math: audit numbers, the auto policy, corrections."""

import math

import pytest
import torch

from megatron_gspo.algo.losses import gspo_loss
from megatron_gspo.algo.precision import (
    ToleranceController,
    apply_correction,
    audit_sums,
    check_engine_logprobs,
    finalize_audit,
    length_bins,
    mismatch_band,
    sequence_mismatch,
)


def _batch(seed=0, b=5, t=8, noise=1e-3):
    g = torch.Generator().manual_seed(seed)
    engine = -torch.rand(b, t, generator=g) * 2 - 0.01
    learner = engine + torch.randn(b, t, generator=g) * noise
    mask = (torch.rand(b, t, generator=g) > 0.25).float()
    mask[3] = 0
    return learner, engine, mask


def test_audit_matches_direct_computation():
    learner, engine, mask = _batch(noise=2e-3)
    s = finalize_audit(audit_sums(learner, engine, mask, eps_low=3e-4, eps_high=4e-4))
    on = mask > 0
    diff = (learner - engine)[on]
    assert s["token_abs_diff_mean"] == pytest.approx(diff.abs().mean().item(), rel=1e-5)
    assert s["token_abs_diff_max"] == pytest.approx(diff.abs().max().item(), rel=1e-6)
    d = [((learner[i] - engine[i])[on[i]]).mean().item() for i in range(5) if on[i].any()]
    assert s["seq_mismatch_mean"] == pytest.approx(sum(d) / len(d), rel=1e-5, abs=1e-8)
    lo, hi = math.log(1 - 3e-4), math.log(1 + 4e-4)
    assert s["out_of_range_fraction"] == pytest.approx(
        sum(1 for x in d if x > hi or x < lo) / len(d))
    dd = diff.double()
    k3 = (torch.expm1(dd) - dd).mean().item()
    assert s["k3_kl"] == pytest.approx(k3, rel=1e-3, abs=1e-10)
    assert s["sequences"] == 4
    md = sequence_mismatch(learner, engine, mask)
    assert md[3].item() == 0.0
    assert md[0].item() == pytest.approx(d[0], rel=1e-5)


def test_audit_by_response_length():
    """The length-bin numbers equal the plain audit restricted to each bin's sequences; empty
    bins are not reported; sequence and token levels."""
    learner, engine, mask = _batch(noise=2e-3, b=7, t=8)
    bins = length_bins(mask, max_new_tokens=8)
    n = (mask > 0).sum(-1)
    assert bins.tolist() == [min(3, 4 * int(k) // 8) for k in n]
    for level, (lo, hi) in (("sequence", (3e-4, 4e-4)), ("token", (2e-3, 2e-3))):
        s = finalize_audit(audit_sums(learner, engine, mask, eps_low=lo, eps_high=hi,
                                      level=level, bins=bins))
        for b in range(4):
            rows = [i for i in range(7) if bins[i] == b and n[i] > 0]
            if not rows:
                assert f"len_bin{b}/sequences" not in s
                continue
            ref = finalize_audit(audit_sums(learner[rows], engine[rows], mask[rows],
                                            eps_low=lo, eps_high=hi, level=level))
            assert s[f"len_bin{b}/sequences"] == ref["sequences"]
            for k in ("seq_abs_mismatch_mean", "token_abs_diff_mean", "out_of_range_fraction"):
                assert s[f"len_bin{b}/{k}"] == pytest.approx(ref[k], rel=1e-5, abs=1e-9)
    plain = finalize_audit(audit_sums(learner, engine, mask, eps_low=3e-4, eps_high=4e-4))
    assert not any(k.startswith("len_bin") for k in plain)


def test_token_level_audit_for_grpo():
    learner, engine, mask = _batch(noise=0.3)
    s = finalize_audit(audit_sums(learner, engine, mask, eps_low=0.2, eps_high=0.28,
                                  level="token"))
    diff = (learner - engine)[mask > 0]
    lo, hi = mismatch_band(0.2, 0.28)
    expect = ((diff > hi) | (diff < lo)).float().mean().item()
    assert s["out_of_range_fraction"] == pytest.approx(expect)
    with pytest.raises(ValueError, match="level"):
        audit_sums(learner, engine, mask, eps_low=0.2, eps_high=0.28, level="x")


def test_rollout_old_logprobs_make_first_ratio_exp_d():
    learner, engine, mask = _batch(noise=5e-3)
    mask[3, 0] = 1  # every row trainable
    d = sequence_mismatch(learner, engine, mask)
    _, st = gspo_loss(learner, engine, torch.ones(5), mask, eps_low=1.0 - 1e-9, eps_high=10.0)
    # ratios of all rows equal exp(d_i): min/max/mean agree with the direct values
    expect = torch.exp(d)
    assert st["ratio_min"].item() == pytest.approx(expect.min().item(), abs=1e-6)
    assert st["ratio_max"].item() == pytest.approx(expect.max().item(), abs=1e-6)
    assert st["ratio_mean"].item() == pytest.approx(expect.mean().item(), abs=1e-6)


def test_mask_and_tis_change_exactly_the_right_sequences():
    d = torch.tensor([0.0, 2e-3, -5e-3, 5e-4, 1.5])
    mask = torch.ones(5, 4)
    mask[4] = 0
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5, 3.0])
    m2, a2, st = apply_correction(d, mask, adv, mode="mask", mask_bound=1e-3)
    assert m2.sum(-1).tolist() == [4, 0, 0, 4, 0]
    assert torch.equal(a2, adv) and st["masked_sequences"] == 2
    m3, a3, st = apply_correction(d, mask, adv, mode="tis", tis_cap=1.002)
    w = torch.clamp(torch.exp(d), max=1.002)
    assert torch.allclose(a3, adv * w)
    assert torch.equal(m3, mask)
    assert a3[0].item() == adv[0].item()  # d = 0 -> weight 1
    assert st["tis_truncated"] == 1  # row 1 (exp(2e-3) > 1.002); row 4 is empty
    m4, a4, _ = apply_correction(d, mask, adv, mode="none")
    assert m4 is mask and a4 is adv
    a_tok = adv[:, None].expand(5, 4)
    _, a5, _ = apply_correction(d, mask, a_tok, mode="tis", tis_cap=10.0)
    assert torch.allclose(a5, a_tok * torch.exp(d)[:, None])


def test_controller_auto_falls_back_and_returns():
    c = ToleranceController(mode="auto", audit_fraction=0.5, tolerance=0.1, recheck_interval=2)
    assert c.needs_learner_logprobs(0)
    assert c.decide(0, {"out_of_range_fraction": 0.0}) == "rollout"
    assert not c.needs_learner_logprobs(1)
    assert c.decide(1, None) == "rollout"
    assert c.needs_learner_logprobs(2)
    assert c.decide(2, {"out_of_range_fraction": 0.5}) == "recompute"
    assert c.events[-1]["switch"] == "rollout->recompute"
    assert c.needs_learner_logprobs(3) and c.needs_learner_logprobs(4)
    assert c.decide(3, {"out_of_range_fraction": 0.01}) == "recompute"
    assert c.decide(4, {"out_of_range_fraction": 0.01}) == "rollout"
    assert c.events[-1]["switch"] == "recompute->rollout"
    state = c.state_dict()
    c2 = ToleranceController(mode="auto")
    c2.load_state_dict(state)
    assert c2.reusing and len(c2.events) == 2


def test_controller_fixed_modes():
    r = ToleranceController(mode="recompute")
    assert all(r.needs_learner_logprobs(s) for s in range(5))
    assert r.decide(0, {"out_of_range_fraction": 0.9}) == "recompute"
    ro = ToleranceController(mode="rollout", audit_fraction=0.25)
    audited = [s for s in range(8) if ro.needs_learner_logprobs(s)]
    assert audited == [0, 4]
    assert ro.decide(0, {"out_of_range_fraction": 1.0}) == "rollout"
    assert not ToleranceController(mode="rollout", audit_fraction=0).needs_learner_logprobs(0)
    with pytest.raises(ValueError, match="old_logprobs"):
        ToleranceController(mode="sometimes")


def test_check_engine_logprobs_names_the_sample():
    check_engine_logprobs(3, [-0.1, 0.0, -2.0], [1, 0, 1], 3)
    with pytest.raises(ValueError, match="sample 7: 2 engine log-probs"):
        check_engine_logprobs(7, [-0.1, -0.2], [1, 1, 1], 3)
    with pytest.raises(ValueError, match="sample 7: token 1 has loss mask 0"):
        check_engine_logprobs(7, [-0.1, -0.2, -0.3], [1, 0, 1], 3)
    with pytest.raises(ValueError, match="not a log-probability"):
        check_engine_logprobs(7, [-0.1, float("nan")], [1, 1], 2)
    with pytest.raises(ValueError, match="returned no log-probs"):
        check_engine_logprobs(7, None, [1], 1)
