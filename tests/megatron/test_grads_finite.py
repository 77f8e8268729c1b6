"""`grads_finite`: finds a NaN / +inf / -inf anywhere in a gradient buffer, and allocates no
temporary of the buffer's size (measured with torch's profiler, CPU memory events)."""

from __future__ import annotations

import types

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron_gspo.megatron.optimizer import grads_finite

N = 1_000_003  # odd: not a multiple of any chunk size


def ddp_like(*buffers: torch.Tensor):
    """A Megatron-DDP-like chunk: `buffers` / `expert_parallel_buffers` with `grad_data`."""
    wrap = [types.SimpleNamespace(grad_data=b) for b in buffers]
    return types.SimpleNamespace(buffers=wrap[:1], expert_parallel_buffers=wrap[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, N // 2, N - 1])
def test_detects_non_finite_anywhere(dtype, bad, where):
    dense, expert = torch.zeros(N, dtype=dtype), torch.ones(7, dtype=dtype)
    assert grads_finite([ddp_like(dense, expert)])
    dense[where] = bad
    assert not grads_finite([ddp_like(dense, expert)])
    dense[where] = 0
    expert[3] = bad
    assert not grads_finite([ddp_like(dense, expert)])


def test_plain_module_grads():
    lin = torch.nn.Linear(4, 3)
    lin(torch.ones(2, 4)).sum().backward()
    assert grads_finite([lin])
    lin.bias.grad[1] = float("nan")
    assert not grads_finite([lin])
    lin.bias.grad[1] = 0.0
    lin.weight.main_grad = torch.full((3, 4), float("-inf"))
    assert not grads_finite([lin])


def test_large_finite_values_are_finite():
    """Values whose sum overflows are still finite gradients."""
    big = torch.full((1000,), torch.finfo(torch.float32).max)
    assert grads_finite([ddp_like(big)])


def test_no_temporary_of_the_buffer_size():
    buf = torch.zeros(N)  # 4 MB; a bool mask of it would be 1 MB
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert grads_finite([ddp_like(buf)])
    biggest = max((e.cpu_memory_usage for e in prof.profiler.function_events), default=0)
    assert biggest < N // 64, f"largest allocation {biggest} bytes for a {N}-element buffer"
