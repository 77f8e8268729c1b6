"""The weight sync's finiteness check of every exported bucket
(`loop.weight_sync_phase._finite`): a NaN or
an infinity anywhere stops the run naming the tensor; large finite weights pass; and the check
reads each weight once, allocating nothing of a weight's size (it runs on every sync)."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.loop.weight_sync_phase import _finite
from megatron_gspo.runtime.rundir import RunError
from tests.megatron.test_logprob_passes import BigAllocations

N = 10_007


def _bucket(dtype=torch.float32):
    return [("a.weight", torch.zeros(N, dtype=dtype)), ("ids", torch.arange(5)),
            ("b.weight", torch.ones(3, 7, dtype=dtype)), ("empty", torch.zeros(0, dtype=dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [("a.weight", 0), ("a.weight", N - 1), ("b.weight", 20)])
def test_a_non_finite_weight_stops_the_sync_naming_it(dtype, bad, where):
    good, b = _bucket(dtype), _bucket(dtype)
    assert list(_finite(iter([good]), version=3)) == [good]
    name, i = where
    dict(b)[name].view(-1)[i] = bad
    with pytest.raises(RunError, match=rf"non-finite \({name}\).*step 2 \(weight version 3\)"):
        list(_finite(iter([good, b]), version=3))


def test_large_finite_weights_pass():
    big = [("w", torch.full((1000,), torch.finfo(torch.float32).max)),
           ("h", torch.full((1000,), torch.finfo(torch.float16).max, dtype=torch.float16)),
           ("n", torch.full((1000,), -torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16))]
    assert list(_finite(iter([big]), version=1)) == [big]


def test_no_temporary_of_a_weight_size():
    bucket = _bucket()
    with BigAllocations(N // 8) as m:
        list(_finite(iter([bucket]), version=1))
    assert m.ops == [], m.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_weights_whose_sum_overflows_pass_and_a_bad_one_among_them_is_named(dtype):
    top = torch.finfo(dtype).max
    big = [("w", torch.full((64,), top, dtype=dtype)), ("x", torch.full((64,), -top, dtype=dtype))]
    assert not torch.isfinite(big[0][1].sum())  # the fast path alone would refuse these
    assert list(_finite(iter([big]), version=1)) == [big]
    big[1][1][7] = float("nan")
    with pytest.raises(RunError, match=r"non-finite \(x\)"):
        list(_finite(iter([big]), version=1))
