"""Turn-level and episode-level advantages, and their use with the GSPO / GSPO-token losses."""

import math

import pytest
import torch

from megatron_gspo.algo.advantages import group_advantages
from megatron_gspo.algo.losses import gspo_loss, gspo_token_loss
from megatron_gspo.algo.turn_advantages import (
    assign_multiturn_advantages,
    discounted_returns,
    episode_level_advantages,
    expand_episode_advantages,
    expand_turn_advantages,
    pad_turn_rewards,
    turn_level_advantages,
)
from megatron_gspo.data.sample import Sample

# group 0: episode A rewards [0, 0, 1], episode B [0, 1]; group 1: episode C [2], D [0]
REWARDS = [[0.0, 0.0, 1.0], [0.0, 1.0], [2.0], [0.0]]
GROUPS = torch.tensor([0, 0, 1, 1])


def test_discounted_returns_by_hand():
    r, m = pad_turn_rewards(REWARDS)
    assert m.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0]]
    g = discounted_returns(r, m, gamma=0.5)
    assert g.tolist() == [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert discounted_returns(r, m, 1.0)[0].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="gamma=1.5"):
        discounted_returns(r, m, 1.5)


def test_pooled_normalisation_by_hand():
    r, m = pad_turn_rewards(REWARDS)
    a = turn_level_advantages(r, m, GROUPS, gamma=0.5, eps=0.0)
    # group 0 returns 0.25, 0.5, 1, 0.5, 1: mean 0.65, unbiased var 0.45 / 4
    std = math.sqrt(0.45 / 4)
    want0 = [(-0.4) / std, (-0.15) / std, 0.35 / std]
    want1 = [(-0.15) / std, 0.35 / std, 0.0]
    assert a[0].tolist() == pytest.approx(want0, abs=1e-6)
    assert a[1].tolist() == pytest.approx(want1, abs=1e-6)
    # group 1 returns 2 and 0: +-1 / sqrt(2)
    assert a[2, 0].item() == pytest.approx(1 / math.sqrt(2)) and a[3, 0].item() == pytest.approx(
        -1 / math.sqrt(2))
    assert a[2, 1:].abs().sum() == 0 and a[3, 1:].abs().sum() == 0


def test_per_turn_normalisation_and_centre_only():
    r, m = pad_turn_rewards(REWARDS)
    a = turn_level_advantages(r, m, GROUPS, gamma=0.5, normalization="per_turn", eps=0.0)
    s = 1 / math.sqrt(2)
    assert a[0].tolist() == pytest.approx([-s, -s, 0.0], abs=1e-6)  # turn 2: only A has one
    assert a[1].tolist() == pytest.approx([s, s, 0.0], abs=1e-6)
    c = turn_level_advantages(r, m, GROUPS, gamma=1.0, scale_by_std=False)
    # group 0 returns 1, 1, 1, 1, 1 -> all zero; group 1: 2, 0 -> +1, -1
    assert c[:2].abs().sum() == 0 and c[2:, 0].tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="normalization 'bogus'"):
        turn_level_advantages(r, m, GROUPS, normalization="bogus")


def test_expand_to_model_tokens_only():
    turn_adv = torch.tensor([[1.0, -2.0, 3.0]])
    turn_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 9]])  # last token: padding
    mask = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 0]])
    assert expand_turn_advantages(turn_adv, turn_ids, mask).tolist() == [
        [1.0, 1.0, 0.0, -2.0, 0.0, 0.0, 3.0, 0.0]]
    with pytest.raises(ValueError, match="out of range"):
        expand_turn_advantages(turn_adv, turn_ids, torch.ones(1, 8))
    assert expand_episode_advantages(torch.tensor([2.0]), mask).tolist() == [
        [2.0, 2.0, 0.0, 2.0, 0.0, 0.0, 2.0, 0.0]]


def test_episode_level_matches_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.5, 3.0, 3.0, 1.0])
    got = episode_level_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert torch.allclose(got, group_advantages(rewards, 3))
    got = episode_level_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), scale_by_std=False)
    assert torch.allclose(got, group_advantages(rewards, 3, scale="none"))


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 1, 1, 1, 1],
                         [1, 0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 1, 1, 1]])
    old = -torch.rand(4, 8, generator=g) * 3
    new = (old + torch.randn(4, 8, generator=g) * 1e-3).requires_grad_(True)
    return new, old, mask


def test_gspo_token_with_episode_advantages_equals_gspo():
    new, old, mask = _batch()
    adv = episode_level_advantages(torch.tensor([1.0, 0.0, 2.0, 0.5]), torch.tensor([0, 0, 1, 1]))
    l1, _ = gspo_loss(new, old, adv, mask)
    (g1,) = torch.autograd.grad(l1, new)
    l2, _ = gspo_token_loss(new, old, expand_episode_advantages(adv, mask), mask)
    (g2,) = torch.autograd.grad(l2, new)
    assert torch.allclose(l1, l2, atol=1e-7, rtol=0)
    assert torch.allclose(g1, g2, atol=1e-7, rtol=0)
    assert g1[mask == 0].abs().sum() == 0 and g1[mask == 1].abs().sum() > 0


def test_turn_advantages_drive_token_gradients():
    """At ratio 1 (unclipped) dL/dlogp_t = -A_t / (N |y|): each turn's tokens get its advantage."""
    old = -torch.rand(2, 6, generator=torch.Generator().manual_seed(1))
    new = old.clone().requires_grad_(True)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 1, 1, 1, 0]])
    turn_ids = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1]])
    r, m = pad_turn_rewards([[0.0, 1.0], [1.0, 0.0]])
    tadv = turn_level_advantages(r, m, torch.tensor([0, 0]), gamma=0.5)
    tok_adv = expand_turn_advantages(tadv, turn_ids, mask)
    loss, _ = gspo_token_loss(new, old, tok_adv, mask)
    (grad,) = torch.autograd.grad(loss, new)
    want = -tok_adv / (2 * mask.sum(-1, keepdim=True))
    assert torch.allclose(grad, want, atol=1e-7)
    assert grad[mask == 0].abs().sum() == 0


def test_assign_on_samples():
    def s(i, g, mask, tids, tr):
        return Sample(prompt_ids=[1], response_ids=list(range(len(mask))), loss_mask=mask,
                      turn_ids=tids, turn_rewards=tr, reward=sum(tr), group_index=g, index=i)

    batch = [s(0, 0, [1, 0, 1], [0, 0, 1], [0.0, 1.0]), s(1, 0, [1, 1], [0, 0], [0.0])]
    assign_multiturn_advantages(batch, mode="turn", gamma=1.0, scale_by_std=False)
    # returns: [1, 1] and [0] -> mean 2/3
    assert batch[0].advantage == pytest.approx([1 / 3, 0.0, 1 / 3])
    assert batch[1].advantage == pytest.approx([-2 / 3, -2 / 3])
    assign_multiturn_advantages(batch, mode="episode", scale_by_std=False)
    assert batch[0].advantage == pytest.approx([0.5, 0.0, 0.5])
    assert batch[1].advantage == pytest.approx([-0.5, -0.5])
    with pytest.raises(ValueError, match="mode 'x'"):
        assign_multiturn_advantages(batch, mode="x")
