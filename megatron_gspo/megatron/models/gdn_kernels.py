"""Torch stand-ins for the gated delta-net kernels Megatron-Core imports from fla / causal-conv1d.

Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv 2412.06464) as Qwen3-Next / Qwen3.5 use it.
Megatron-Core's `GatedDeltaNet` (0.16.1: `ssm/gated_delta_net.py`; 0.19.2:
`ssm/gated_delta_net/common.py` + `gdn.py`) imports Triton kernels from flash-linear-attention
(`fla.modules.l2norm.l2norm`, `fla.ops.gated_delta_rule.chunk_gated_delta_rule`, and in 0.19.2
`fla.modules.convolution.causal_conv1d`) and refuses to build without them (`HAVE_FLA`). It
carries its own torch chunked rule (`torch_chunk_gated_delta_rule`, used in deterministic mode);
0.16.1 uses `nn.Conv1d` when Dao-AILab's `causal_conv1d_fn` is missing. What a CPU lacks is
therefore the l2 norm and (0.19.2) fla's causal convolution; both are written here from their
definitions:

- `l2norm(x)`: x / sqrt(sum_d x_d^2 + eps) over the last dim, in fp32, cast back
  (fla's `l2norm_fwd`; eps 1e-6).
- `causal_conv1d(x [B, T, D], weight [D, W], bias, activation, initial_state, cu_seqlens, ...)`:
  depthwise causal convolution y_t = act(b + sum_{i<W} w_{W-1-i} x_{t-i}) with fla's return
  value (y, final_state [N, D, W] or None); packed sequences (`cu_seqlens`, B == 1) restart at
  each boundary.
- `causal_conv1d_fn(x [B, D, T], weight [D, W], bias, activation)`: the same in Dao-AILab's layout.

`bind()` puts them (and the torch chunked rule for `chunk_gated_delta_rule`) into Megatron-Core's
module namespaces when fla is not installed; with fla installed (GPU) it changes nothing.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
import torch.nn.functional as F

_ACTIVATIONS = {None: lambda t: t, "silu": F.silu, "swish": F.silu}


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6,
           output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fla's `l2norm`: x / sqrt(sum(x^2) + eps) along `dim`, computed in fp32.

    Args:
        x: any shape; normalised along `dim` (fla: the last dim).
        eps: added to the squared norm.
        output_dtype: result dtype (default: x's).
    Returns:
        Tensor of x's shape.
    """
    xf = x.float()
    y = xf * torch.rsqrt((xf * xf).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _conv_one(x: torch.Tensor, weight: torch.Tensor, bias, state):
    """x [B, D, T], weight [D, W], state [B, D, W] or None
    -> (pre-activation y [B, D, T], the last W inputs [B, D, W])."""
    width = weight.shape[-1]
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[1], width)
    padded = torch.cat([state[..., 1:].to(x.dtype), x], dim=-1)  # [B, D, W - 1 + T]
    b = None if bias is None else bias.to(x.dtype)
    y = F.conv1d(padded, weight.unsqueeze(1).to(x.dtype), b, groups=x.shape[1])
    full = torch.cat([state.to(x.dtype), x], dim=-1)
    return y, full[..., -width:]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, activation: str | None = None,
                  cu_seqlens: torch.Tensor | None = None, **_unused):
    """fla's `causal_conv1d` (fla/modules/convolution.py), torch only.

    Args:
        x: [B, T, D] inputs (B == 1 with `cu_seqlens`).
        weight: [D, W] depthwise kernels; bias: [D] or None.
        residual: [B, T, D] added after the activation, or None.
        initial_state: [N, D, W] the last W inputs before each sequence, or None (zeros).
        output_final_state: also return the last W inputs of each sequence.
        activation: None, "silu" or "swish".
        cu_seqlens: [N + 1] boundaries of packed sequences along T, or None.
    Returns:
        (y [B, T, D], final_state [N, D, W] or None).
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not silu / swish / None")
    xt = x.transpose(1, 2)  # [B, D, T]
    if cu_seqlens is None:
        y, final = _conv_one(xt, weight, bias, initial_state)
    else:
        if x.shape[0] != 1:
            raise ValueError(f"causal_conv1d: cu_seqlens needs batch 1, got {x.shape[0]}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        outs, finals = [], []
        for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            state = None if initial_state is None else initial_state[n:n + 1]
            y_n, f_n = _conv_one(xt[..., lo:hi], weight, bias, state)
            outs.append(y_n)
            finals.append(f_n)
        y, final = torch.cat(outs, dim=-1), torch.cat(finals, dim=0)
    y = _ACTIVATIONS[activation](y).transpose(1, 2)
    if residual is not None:
        y = y + residual
    return y.to(x.dtype), (final if output_final_state else None)


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     seq_idx=None, initial_states: torch.Tensor | None = None,
                     return_final_states: bool = False, final_states_out=None,
                     activation: str | None = None):
    """Dao-AILab `causal_conv1d_fn`, torch only.

    Args:
        x: [B, D, T]; weight: [D, W]; bias: [D] or None.
        initial_states: [B, D, W - 1] or None.
        activation: None, "silu" or "swish".
    Returns:
        y [B, D, T] (and final states [B, D, W - 1] when `return_final_states`).
    """
    if seq_idx is not None or final_states_out is not None:
        raise NotImplementedError("causal_conv1d_fn stand-in: no seq_idx / final_states_out")
    state = None
    if initial_states is not None:
        pad = initial_states.new_zeros(*initial_states.shape[:2], 1)
        state = torch.cat([pad, initial_states], dim=-1)
    y, final = causal_conv1d(x.transpose(1, 2), weight, bias, initial_state=state,
                             output_final_state=True, activation=activation)
    y = y.transpose(1, 2)
    return (y, final[..., 1:]) if return_final_states else y


def fla_available() -> bool:
    """True when flash-linear-attention is importable (its kernels are then used unchanged)."""
    return importlib.util.find_spec("fla") is not None


def bind() -> bool:
    """Give Megatron-Core's GatedDeltaNet modules the torch kernels where fla is missing.

    Returns:
        True when stand-ins were bound, False when fla is installed (nothing changed).
    """
    if fla_available():
        return False
    names = ("megatron.core.ssm.gated_delta_net", "megatron.core.ssm.gated_delta_net.common",
             "megatron.core.ssm.gated_delta_net.gdn")
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        rule = getattr(mod, "torch_chunk_gated_delta_rule", None)
        if rule is None:
            rule = importlib.import_module(names[0]).torch_chunk_gated_delta_rule
        mod.l2norm = l2norm
        mod.chunk_gated_delta_rule = rule
        mod.HAVE_FLA = True
        if hasattr(mod, "causal_conv1d"):  # 0.19.2: fla's convolution
            mod.causal_conv1d = causal_conv1d
    return True
