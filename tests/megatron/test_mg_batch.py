"""Packing plan and packed micro-batches (pure Python / torch)."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.data.batch import (BatchError, cp_local_index, pack_microbatch,
                                      pad_microbatch, plan_microbatches)
from megatron_gspo.data.sample import Sample


def _s(p, r, i=0, adv=1.0, mask=None, lp=None):
    return Sample(prompt_ids=p, response_ids=r, index=i, advantage=adv, loss_mask=mask,
                  rollout_logprobs=lp)


def test_plan_balances_and_keeps_microbatch_count_equal():
    lengths = [10, 3, 7, 7, 2, 9, 4, 1]
    plan = plan_microbatches(lengths, 2, num_microbatches=2)
    assert len(plan) == 2 and all(len(p) == 2 for p in plan)
    flat = sorted(i for p in plan for mb in p for i in mb)
    assert flat == list(range(8))
    loads = [sum(lengths[i] for mb in p for i in mb) for p in plan]
    assert abs(loads[0] - loads[1]) <= max(lengths)


def test_plan_token_budget_and_errors():
    plan = plan_microbatches([5] * 6, 1, max_tokens=10)
    assert len(plan[0]) == 3 and all(sum(5 for _ in mb) <= 10 for mb in plan[0])
    with pytest.raises(BatchError, match="cannot feed 4"):
        plan_microbatches([1, 2], 4)
    with pytest.raises(BatchError, match="3 micro-batches"):
        plan_microbatches([1, 2, 3, 4], 2, num_microbatches=3)


def test_pack_alignment_positions_and_boundaries():
    a = _s([11, 12], [13, 14, 15], 0, adv=0.5, mask=[1, 0, 1], lp=[-1.0, -2.0, -3.0])
    b = _s([21], [22, 23], 1, adv=-1.0, lp=[-4.0, -5.0])
    mb = pack_microbatch([a, b], [0, 1], total_multiple=5)
    assert mb.tokens.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    assert mb.cu_seqlens.tolist() == [0, 5, 8, 10]
    # position t predicts token t+1; response token j is scored at P+j-1
    assert mb.targets[0, :5].tolist() == [12, 13, 14, 15, 0]
    assert mb.loss_mask[0].tolist() == [0, 1, 0, 1, 0, 1, 1, 0, 0, 0]
    assert mb.old_logprobs[0, :8].tolist() == [0, -1, -2, -3, 0, -4, -5, 0]
    assert mb.seq_advantages.tolist() == [0.5, -1.0]
    rows = mb.rows(mb.loss_mask)
    assert rows.tolist() == [[0, 1, 0, 1, 0], [1, 1, 0, 0, 0]]
    assert mb.num_sequences == 2


def test_pack_rejects_misaligned_logprobs_and_pads_rows():
    a = _s([1, 2], [3, 4])
    with pytest.raises(BatchError, match="2 response tokens"):
        pack_microbatch([a], [0], old_logprobs=[[-1.0]])
    mb = pack_microbatch([a], [0], old_logprobs=[[-1.0, -1.0]])
    p = pad_microbatch(mb, 7)
    assert p.seq_len == 7 and p.cu_seqlens.tolist() == [0, 4, 7]
    assert p.loss_mask[0, 4:].sum() == 0


def test_cp_split_takes_chunks_r_and_2cp_minus_1_minus_r():
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    r0 = cp_local_index(cu, 2, 0).tolist()
    r1 = cp_local_index(cu, 2, 1).tolist()
    assert r0 == [0, 1, 6, 7, 8, 11]
    assert r1 == [2, 3, 4, 5, 9, 10]
    assert sorted(r0 + r1) == list(range(12))
    with pytest.raises(BatchError, match="multiple of 2\\*cp"):
        cp_local_index(torch.tensor([0, 6], dtype=torch.int32), 2, 0)
