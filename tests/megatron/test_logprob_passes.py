"""Single-rank token log-probs (`vocab_parallel_logprobs` without a TP group, the pi_old
recompute's forward step): the values, entropy and gradient of float64 log-softmax, the logits
left untouched, and the number of vocabulary-sized tensors each call allocates (one fused
log-softmax, plus one exp when the entropy is asked for; the pi_old recompute does not compute
the entropy it does not return)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_gspo.megatron import step
from megatron_gspo.megatron.tp_logprobs import vocab_parallel_logprobs

N, V, REAL = 13, 96, 80  # 16 padded vocabulary columns


class BigAllocations(TorchDispatchMode):
    """Names of the ops that return a new tensor of at least `numel` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.numel() >= self.numel
                    and t.untyped_storage().data_ptr() not in inputs):
                self.ops.append(func.__name__)
        return out


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * 3
    targets = torch.randint(0, REAL, (N,), generator=g)
    return logits, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [4, 4096])
def test_values_entropy_and_grad_equal_float64_log_softmax(temperature, chunk):
    logits, targets = _inputs()
    before = logits.clone()
    mine = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(mine, targets, temperature=temperature, vocab_size=REAL,
                                      chunk_size=chunk, return_entropy=True)
    ref_in = logits[:, :REAL].double().requires_grad_(True)
    ls = torch.log_softmax(ref_in / temperature, -1)
    ref = ls.gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(lp.double(), ref, atol=1e-6, rtol=1e-6)
    assert torch.allclose(ent.double(), -(ls.exp() * ls).sum(-1).detach(), atol=1e-5, rtol=0)
    w = torch.randn(N, generator=torch.Generator().manual_seed(1))
    (lp * w).sum().backward()
    (ref * w.double()).sum().backward()
    want = torch.cat([ref_in.grad, torch.zeros(N, V - REAL, dtype=torch.float64)], 1)
    assert torch.allclose(mine.grad.double(), want, atol=1e-6, rtol=0)
    assert torch.equal(mine.detach(), before)  # the logits are never modified in place
    alone = vocab_parallel_logprobs(logits, targets, temperature=temperature, vocab_size=REAL,
                                    chunk_size=chunk)
    assert torch.equal(alone, lp.detach())


def test_entropy_with_minus_inf_logits():
    logits, targets = _inputs(2)
    logits[3, 40:] = float("-inf")
    targets[3] = 5
    lp, ent = vocab_parallel_logprobs(logits, targets, vocab_size=REAL, return_entropy=True)
    ls = torch.log_softmax(logits[:, :REAL].double(), -1)
    ref = -torch.where(ls > float("-inf"), ls.exp() * ls, torch.zeros((), dtype=ls.dtype)).sum(-1)
    assert torch.isfinite(ent).all() and torch.isfinite(lp).all()
    assert torch.allclose(ent.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,allowed", [(1.0, 1), (0.7, 2)])
def test_one_vocabulary_sized_tensor_per_pass(temperature, allowed):
    logits, targets = _inputs()
    with torch.no_grad(), BigAllocations(N * REAL) as m:
        vocab_parallel_logprobs(logits, targets, temperature=temperature, vocab_size=REAL)
    assert len(m.ops) <= allowed, m.ops  # log-softmax (and the division by T)
    with torch.no_grad(), BigAllocations(N * REAL) as m:
        vocab_parallel_logprobs(logits, targets, temperature=temperature, vocab_size=REAL,
                                return_entropy=True)
    assert len(m.ops) <= allowed + 1, m.ops  # + exp for the entropy


def test_pi_old_forward_step_computes_no_entropy():
    """The forward-only step of `Learner.forward_logprobs` (the pi_old recompute) returns the
    log-probs alone and allocates only the log-softmax and the division by T."""
    logits, targets = _inputs(3)
    data = {"tokens": targets[None], "position_ids": torch.arange(N)[None],
            "packed_seq_params": None, "targets": targets, "local_index": torch.arange(N),
            "seq_len": N}
    ctx = step.ParallelContext(vocab_size=REAL)
    fstep = step.logprob_forward_step_factory(ctx, 0.7)
    out, collect = fstep(iter([data]), lambda *a, **k: logits[None])
    with BigAllocations(N * REAL) as m:
        _, got = collect(out)
    assert set(got) == {"logprobs"}
    assert len(m.ops) <= 2, m.ops
    ref = torch.log_softmax(logits[:, :REAL].double() / 0.7, -1).gather(-1, targets[:, None])
    assert torch.allclose(got["logprobs"].double(), ref.squeeze(-1), atol=1e-6, rtol=1e-6)
    _, both = step.logprob_forward_step_factory(ctx, 0.7, with_entropy=True)(
        iter([data]), lambda *a, **k: logits[None])[1](out)
    assert set(both) == {"logprobs", "entropy"}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype,allowed", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_backward_writes_the_gradient_in_place(temperature, dtype, allowed):
    """The backward pass makes the gradient and nothing else of the vocabulary's size for
    float32 logits (one float32 chunk more for other dtypes), and it is the float64 one."""
    logits, targets = _inputs(4)
    mine = logits.to(dtype).clone().requires_grad_(True)
    lp = vocab_parallel_logprobs(mine, targets, temperature=temperature, vocab_size=REAL)
    w = torch.randn(N, generator=torch.Generator().manual_seed(5))
    with BigAllocations(N * REAL) as m:
        (lp * w).sum().backward()
    assert len(m.ops) <= allowed, m.ops
    ref_in = logits.to(dtype)[:, :REAL].double().requires_grad_(True)
    ref = torch.log_softmax(ref_in / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
    (ref * w.double()).sum().backward()
    want = torch.cat([ref_in.grad, torch.zeros(N, V - REAL, dtype=torch.float64)], 1)
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # float32 rounding of z / T, exp
    assert torch.allclose(mine.grad.double(), want, atol=tol, rtol=0)
    assert mine.grad.dtype == dtype
