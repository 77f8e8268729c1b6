"""The torch stand-ins for fla's `l2norm` / `causal_conv1d` and Dao-AILab's `causal_conv1d_fn`
(megatron_gspo/megatron/models/gdn_kernels.py) against transformers' qwen3_next torch paths
(`l2norm`, `causal_conv1d_fn`, `causal_conv1d_update`), to <= 1e-6 in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_gspo.megatron.models import gdn_kernels as gk

TOL = 1e-6


def _hf():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    return m


def test_l2norm_matches_transformers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, 16, generator=g)
    ours, ref = gk.l2norm(x), _hf().l2norm(x, dim=-1, eps=1e-6)
    assert (ours - ref).abs().max().item() <= TOL
    assert torch.allclose(ours.norm(dim=-1), torch.ones(2, 7, 3), atol=1e-5)
    assert gk.l2norm(x.bfloat16()).dtype == torch.bfloat16
    assert gk.l2norm(x, output_dtype=torch.float64).dtype == torch.float64


def _conv_case(seed: int, b=2, d=12, t=9, w=4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, d, t, generator=g), torch.randn(d, w, generator=g),
            torch.randn(d, generator=g))


def test_causal_conv1d_fn_matches_transformers():
    x, w, bias = _conv_case(1)
    for act in (None, "silu"):
        for b in (None, bias):
            ref = _hf().causal_conv1d_fn(x, w, b, activation=act)
            ours = gk.causal_conv1d_fn(x, w, b, activation=act)
            assert (ours - ref).abs().max().item() <= TOL
            y, _ = gk.causal_conv1d(x.transpose(1, 2), w, b, activation=act)  # fla layout
            assert (y.transpose(1, 2) - ref).abs().max().item() <= TOL


def test_causal_conv1d_is_causal_and_equals_torch_conv():
    x, w, bias = _conv_case(2)
    conv = F.conv1d(x, w.unsqueeze(1), bias, padding=w.shape[-1] - 1, groups=x.shape[1])
    y, _ = gk.causal_conv1d(x.transpose(1, 2), w, bias)
    assert (y.transpose(1, 2) - conv[..., :x.shape[-1]]).abs().max().item() <= TOL
    x2 = x.clone()
    x2[..., 5:] += 1.0  # a change at t >= 5 leaves t < 5 alone
    y2, _ = gk.causal_conv1d(x2.transpose(1, 2), w, bias)
    assert torch.equal(y2[:, :5], y[:, :5]) and not torch.equal(y2[:, 5:], y[:, 5:])


def test_final_state_continues_like_transformers_decode():
    """Prefill with the stand-in, then decode token by token with transformers'
    `causal_conv1d_update` from our final state: equals one pass over the whole sequence."""
    x, w, bias = _conv_case(3, t=10)
    full, _ = gk.causal_conv1d(x.transpose(1, 2), w, bias, activation="silu")
    pre, state = gk.causal_conv1d(x[..., :6].transpose(1, 2), w, bias, activation="silu",
                                  output_final_state=True)
    assert state.shape == (2, 12, 4)
    assert (pre - full[:, :6]).abs().max().item() <= TOL
    state = state.clone()
    for t in range(6, 10):
        step = _hf().causal_conv1d_update(x[..., t:t + 1], state, w, bias, activation="silu")
        assert (step[..., 0] - full[:, t]).abs().max().item() <= TOL
    # and our own initial_state path: the rest of the sequence from the prefill state
    _, state6 = gk.causal_conv1d(x[..., :6].transpose(1, 2), w, bias, output_final_state=True)
    rest, _ = gk.causal_conv1d(x[..., 6:].transpose(1, 2), w, bias, activation="silu",
                               initial_state=state6)
    assert (rest - full[:, 6:]).abs().max().item() <= TOL
    y_fn, fin = gk.causal_conv1d_fn(x[..., 6:], w, bias, initial_states=state6[..., 1:],
                                    return_final_states=True, activation="silu")
    assert (y_fn.transpose(1, 2) - full[:, 6:]).abs().max().item() <= TOL
    assert fin.shape == (2, 12, 3)


def test_packed_sequences_restart_at_boundaries():
    x, w, bias = _conv_case(4, b=1, t=11)
    cu = torch.tensor([0, 4, 11])
    y, final = gk.causal_conv1d(x.transpose(1, 2), w, bias, activation="silu", cu_seqlens=cu,
                                output_final_state=True)
    for lo, hi in ((0, 4), (4, 11)):
        ref = _hf().causal_conv1d_fn(x[..., lo:hi], w, bias, activation="silu")
        assert (y[:, lo:hi].transpose(1, 2) - ref).abs().max().item() <= TOL
    assert final.shape == (2, 12, 4)
    assert torch.equal(final[1], x[0, :, 7:11])


def test_gradients_flow():
    x, w, bias = _conv_case(5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y, _ = gk.causal_conv1d(x.transpose(1, 2), w, bias, activation="silu")
    gk.l2norm(y).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and w.grad.abs().sum() > 0
