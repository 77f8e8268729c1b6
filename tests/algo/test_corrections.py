"""IcePop token masking, MIS, DeepSeek-V3.2 off-policy sequence masking (`algo.corrections`,
through `precision.apply_correction`) and DAPO's overlong options (`rewards.overlong`)."""

import math

import pytest
import torch

from megatron_gspo.algo.corrections import (icepop_token_mask, mis_weights,
                                            offpolicy_sequence_mask)
from megatron_gspo.algo.precision import apply_correction, sequence_mismatch
from megatron_gspo.data.sample import Sample
from megatron_gspo.rewards.overlong import apply_overlong, soft_overlong_penalty


def test_icepop_drops_exactly_the_tokens_outside_the_band():
    k = torch.tensor([[0.49, 0.51, 1.0, 4.99, 5.01], [0.1, 1.0, 1.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [0, 1, 1, 1, 1]])  # [1, 0] is not trained anyway
    new, drop = icepop_token_mask(torch.log(k), mask, low=0.5, high=5.0)
    assert new.tolist() == [[0, 1, 1, 1, 0], [0, 1, 1, 1, 0]]
    assert int(drop.sum()) == 3
    d = sequence_mismatch(torch.log(k), torch.zeros_like(k), mask)
    m2, a2, st = apply_correction(d, mask, torch.ones(2), mode="icepop",
                                  token_log_ratio=torch.log(k))
    assert torch.equal(m2, new) and st["masked_tokens"] == 3.0 and st["masked_sequences"] == 0
    assert torch.equal(a2, torch.ones(2))  # masking only: advantages untouched
    with pytest.raises(ValueError, match="token log-ratios"):
        apply_correction(d, mask, torch.ones(2), mode="icepop")


def test_mis_keeps_the_weight_below_the_cap_and_drops_the_sequence_above():
    d = torch.tensor([0.1, math.log(3.0), -0.2, 0.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    w, drop = mis_weights(d, mask, cap=2.0)
    assert drop.tolist() == [False, True, False, False]
    torch.testing.assert_close(w[[0, 2]], torch.exp(d[[0, 2]]))
    new_mask, adv, st = apply_correction(d, mask, torch.tensor([1.0, 1.0, -1.0, 0.5]),
                                         mode="mis", tis_cap=2.0)
    assert new_mask[1].sum() == 0 and new_mask[0].sum() == 2 and st["masked_sequences"] == 1
    torch.testing.assert_close(adv[[0, 2]], torch.tensor([math.exp(0.1), -math.exp(-0.2)]))
    # TIS keeps the same sequence with the truncated weight C
    _, adv_t, st_t = apply_correction(d, mask, torch.ones(4), mode="tis", tis_cap=2.0)
    assert float(adv_t[1]) == pytest.approx(2.0) and st_t["tis_truncated"] == 1.0


def test_offpolicy_mask_drops_only_negative_advantage_sequences_beyond_delta():
    old = torch.zeros(4, 3)
    # KL_i = mean(old - logp): 0.5, 0.5, 0.01, 0.5
    logp = torch.tensor([[-0.5] * 3, [-0.5] * 3, [-0.01] * 3, [-0.5] * 3])
    mask = torch.ones(4, 3)
    mask[3] = 0
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0])
    new, rows, kl = offpolicy_sequence_mask(logp, old, adv, mask, delta=0.1)
    assert rows.tolist() == [True, False, False, False]
    assert new[0].sum() == 0 and new[1:3].sum() == 6
    torch.testing.assert_close(kl[:3], torch.tensor([0.5, 0.5, 0.01]))
    # per-token advantages: the tokens with A_it < 0 of a sequence beyond delta
    tok = torch.tensor([[-1.0, 2.0, -1.0]] + [[1.0] * 3] * 3)
    new_t, rows_t, _ = offpolicy_sequence_mask(logp, old, tok, mask, delta=0.1)
    assert new_t[0].tolist() == [0.0, 1.0, 0.0] and rows_t.tolist() == [True, False, False,
                                                                         False]


def test_soft_overlong_punishment_follows_dapo_eq_13():
    # L_max = 20, L_cache = 5: free up to 15, then linear to -1 at 20
    assert soft_overlong_penalty(15, 20, 5) == 0.0
    assert soft_overlong_penalty(16, 20, 5) == pytest.approx(-0.2)
    assert soft_overlong_penalty(20, 20, 5) == pytest.approx(-1.0)
    assert soft_overlong_penalty(21, 20, 5) == -1.0
    assert soft_overlong_penalty(18, 20, 5, factor=0.5) == pytest.approx(-0.3)
    with pytest.raises(ValueError):
        soft_overlong_penalty(3, 20, 0)


def _sample(i, n, reason, reward=1.0):
    return Sample(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), loss_mask=[1] * n,
                  index=i, reward=reward, finish_reason=reason)


def test_overlong_filter_masks_truncated_responses_and_reports_the_share():
    s = [_sample(0, 4, "stop"), _sample(1, 8, "length"), _sample(2, 7, "stop"),
         _sample(3, 8, "length")]
    m = apply_overlong(s, max_length=8, buffer=2, factor=1.0, filter_truncated=True)
    assert [x.num_trainable for x in s] == [4, 0, 7, 0]
    assert [x.reward for x in s] == pytest.approx([1.0, 0.0, 0.5, 0.0])
    assert m["reward/overlong_filtered_share"] == 0.5
    assert m["reward/overlong_punished_share"] == 0.75
