"""Slices of one HF tensor that holds every expert of a layer ([E, ...], gpt-oss), the layout
kinds of `ParamMap` that take them (`ParamMap.index` is the expert), and the collector that
stacks the exported pieces back.

- ``fused_fc1``: ``gate_up_proj`` [E, H, 2F], gate / up interleaved along 2F -> Megatron
  ``linear_fc1.weight`` [2F, H] = [gate; up];
- ``fused_fc1_bias``: ``gate_up_proj_bias`` [E, 2F] (interleaved) -> [gate; up];
- ``fused_fc2``: ``down_proj`` [E, F, H] -> ``linear_fc2.weight`` [H, F];
- ``slice``: ``down_proj_bias`` [E, H] -> [H].
"""

from __future__ import annotations

import torch

SLICE_KINDS = ("fused_fc1", "fused_fc1_bias", "fused_fc2", "slice")


def slice_to_mcore(kind: str, t: torch.Tensor) -> torch.Tensor:
    """One expert's slice of the HF tensor -> the Megatron tensor."""
    if kind == "fused_fc1":  # [H, 2F] interleaved columns -> rows
        t = t.t()
    if kind in ("fused_fc1", "fused_fc1_bias"):
        return torch.cat([t[0::2], t[1::2]], dim=0).contiguous()
    return (t.t() if kind == "fused_fc2" else t).contiguous()


def slice_to_hf(kind: str, full: torch.Tensor) -> torch.Tensor:
    """The Megatron tensor of one expert -> its slice of the HF tensor."""
    if kind in ("fused_fc1", "fused_fc1_bias"):
        gate, up = torch.chunk(full, 2, dim=0)
        full = torch.stack([gate, up], dim=1).reshape(full.shape)  # re-interleave rows
    return (full.t() if kind in ("fused_fc1", "fused_fc2") else full).contiguous()


class ExpertSlices:
    """Collects the per-expert pieces of [E, ...] HF tensors (SLICE_KINDS) and hands each tensor
    out, stacked in expert order, once its last piece arrived."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, pm, name: str, piece: torch.Tensor | None) -> torch.Tensor | bool:
        """Add expert `pm.index`'s piece of `name` (None: count it only, for shape metadata).

        Returns:
            the stacked tensor when complete (True when counting), else False.
        """
        got = self.parts.setdefault(name, {})
        got[pm.index] = piece
        if len(got) < pm.shapes[0][0]:
            return False
        del self.parts[name]
        return True if piece is None else torch.stack([got[e] for e in sorted(got)])
