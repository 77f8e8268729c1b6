"""Group advantages never produce NaN/inf: an all-equal group gets exactly zero, whatever eps."""

import torch

from megatron_gspo.algo.advantages import group_advantages


def test_zero_variance_group_is_zero_even_with_eps_0():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    adv = group_advantages(rewards, 4, eps=0.0)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:4], torch.zeros(4))
    assert adv[4] < 0 < adv[5]


def test_equal_inexact_rewards_give_exact_zeros():
    # 0.1 is not representable: the float32 mean of four 0.1s differs from 0.1 in the last bit
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7])
    for scale in ("std", "none"):
        adv = group_advantages(rewards, 4, scale=scale, eps=0.0)
        assert torch.equal(adv, torch.zeros(8)), (scale, adv)
    adv = group_advantages(rewards, 4, eps=1e-6)
    assert torch.equal(adv, torch.zeros(8))
