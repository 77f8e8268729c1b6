"""Bugs other GSPO-family trainers shipped, each with a check that catches it. Every check runs
on our implementation (must pass) and on a faithful re-creation of the bug (must fail), so a
check that cannot fail is itself a test failure.

  - a GSPO loss that weights each sequence by its length (TRL #3823),
  - token-sum aggregation of the GSPO sequence term (ROLL #165),
  - a sequence-level IS weight computed as exp(sum) instead of exp(mean) (NeMo-RL #2269).
The dp_size^2 denominator (verl #5798) and the KL term ignored by some losses (slime #397) are
covered in tests/megatron/test_family_step.py and the multi-process DP2 test.
"""

import math

import pytest
import torch

from megatron_gspo.algo.gmpo import gmpo_loss
from megatron_gspo.algo.losses import gspo_loss, gspo_token_loss
from megatron_gspo.algo.precision import apply_correction, sequence_mismatch


def _pair(n_short=2, n_long=8, delta=0.0):
    """A short sequence with A = +1 and a long one with A = -1, per-token log-ratio delta."""
    t = max(n_short, n_long)
    lp = torch.full((2, t), -1.0)
    mask = torch.zeros(2, t)
    mask[0, :n_short], mask[1, :n_long] = 1, 1
    return lp, lp - delta, mask, torch.tensor([1.0, -1.0])


def check_equal_sequence_weights(loss_fn) -> None:
    """Each sequence is one term: the loss equals the mean of the one-sequence losses and the
    gradient summed over a sequence's tokens is the same for a 2- and an 8-token response."""
    lp, old, mask, adv = _pair(delta=1e-4)
    lp = lp.clone().requires_grad_(True)
    loss, _ = loss_fn(lp, old, adv, mask, num_sequences=2)
    loss.backward()
    singles = [float(loss_fn(lp[i:i + 1].detach(), old[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                             num_sequences=1)[0]) for i in range(2)]
    assert float(loss.detach()) == pytest.approx(sum(singles) / 2, abs=1e-7), "length-weighted"
    per_seq = (lp.grad * mask).sum(-1).abs()
    assert float(per_seq[0]) == pytest.approx(float(per_seq[1]), rel=1e-4), "length-weighted"


def check_length_invariant_sequence_term(loss_fn) -> None:
    """Repeating every token of a response (same ratios, twice the length) leaves the loss
    unchanged: the sequence term is a token MEAN, never a token sum."""
    lp, old, mask, adv = _pair(4, 4, delta=2e-4)
    long_lp, long_old, long_mask = (torch.cat([x, x], -1) for x in (lp, old, mask))
    a = float(loss_fn(lp, old, adv * torch.tensor([1.0, 0.5]), mask, num_sequences=2)[0])
    b = float(loss_fn(long_lp, long_old, adv * torch.tensor([1.0, 0.5]), long_mask,
                      num_sequences=2)[0])
    assert a == pytest.approx(b, rel=1e-6), "token-sum aggregation"


def _gspo_length_weighted(lp, old, adv, mask, num_sequences=None):
    """TRL #3823: sequence ratio per token, then a token mean over the whole batch."""
    d = ((lp - old) * mask).sum(-1) / mask.sum(-1)
    s = torch.exp(d)[:, None] * torch.exp(lp - lp.detach())
    term = -torch.minimum(s * adv[:, None], s.clamp(1 - 3e-4, 1 + 4e-4) * adv[:, None])
    return (term * mask).sum() / mask.sum(), {}


def _gspo_token_sum(lp, old, adv, mask, num_sequences=None):
    """ROLL #165: the per-token copies of the sequence term summed, not averaged."""
    d = ((lp - old) * mask).sum(-1) / mask.sum(-1)
    s = torch.exp(d)
    term = -torch.minimum(s * adv, s.clamp(1 - 3e-4, 1 + 4e-4) * adv)
    return (term * mask.sum(-1)).sum() / num_sequences, {}


OURS = {"gspo": gspo_loss, "gspo_token": gspo_token_loss,
        "gmpo": lambda *a, **k: gmpo_loss(*a, eps_low=0.4, eps_high=0.4, **k)}


@pytest.mark.parametrize("name", sorted(OURS))
def test_sequence_losses_weight_sequences_equally_and_average_tokens(name):
    check_equal_sequence_weights(OURS[name])
    check_length_invariant_sequence_term(OURS[name])


@pytest.mark.parametrize("bug, check", [
    (_gspo_length_weighted, check_equal_sequence_weights),
    (_gspo_token_sum, check_equal_sequence_weights),
    (_gspo_token_sum, check_length_invariant_sequence_term)])
def test_the_checks_catch_the_length_weighting_bugs(bug, check):
    with pytest.raises(AssertionError):
        check(bug)


def check_sequence_is_weight_is_a_geometric_mean(correct) -> None:
    """A 1000-token response with a per-token log-mismatch of 1e-3 gets weight e^1e-3 (TIS and
    MIS), a 10-token one with the same per-token mismatch the same weight."""
    for length in (10, 1000):
        learner = torch.full((1, length), -1.0 + 1e-3)
        engine = torch.full((1, length), -1.0)
        mask = torch.ones(1, length)
        for mode in ("tis", "mis"):
            _, adv, _ = correct(learner, engine, mask, torch.ones(1), mode)
            assert float(adv[0]) == pytest.approx(math.exp(1e-3), rel=1e-6), f"{mode} exp(sum)"


def _ours_correct(learner, engine, mask, adv, mode):
    return apply_correction(sequence_mismatch(learner, engine, mask), mask, adv, mode=mode,
                            tis_cap=2.0)


def _exp_sum_correct(learner, engine, mask, adv, mode):
    """NeMo-RL #2269: the sequence weight as exp(sum_t log k_t)."""
    w = torch.exp(((learner - engine) * mask).sum(-1)).clamp(max=2.0)
    return mask, adv * w, {}


def test_sequence_is_weight_is_exp_of_the_mean_and_the_check_catches_exp_sum():
    check_sequence_is_weight_is_a_geometric_mean(_ours_correct)
    with pytest.raises(AssertionError):
        check_sequence_is_weight_is_a_geometric_mean(_exp_sum_correct)
