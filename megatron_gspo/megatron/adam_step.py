"""Adam's step count (its bias correction) of a Megatron optimizer, read and restored wherever
the inner optimizer keeps it:

- torch.optim.Adam / AdamW (the CPU fallback): `optimizer.state[p]["step"]`, one per parameter;
- Transformer Engine's FusedAdam (what Megatron-Core picks on GPU; apex's FusedAdam likewise):
  `param_group["step"]`, one per group with parameters, an int (a CUDA tensor when
  `capturable`), no per-parameter entry. Upstream: TransformerEngine v2.11
  transformer_engine/pytorch/optimizers/fused_adam.py, `FusedAdam.step` ("if 'step' in group:
  group['step'] += 1 ... else: group['step'] = 1"); Megatron-Core 0.16.1's
  distrib_optimizer.py reads it from the param groups for TE / apex.

Used by the learner's checkpoints: the distributed optimizer's reshardable format restores a
dummy step, so the saved count is put back in both places.
"""

from __future__ import annotations

import torch


def _inner(optimizer) -> list:
    """The torch optimizers inside a (chained) Megatron optimizer."""
    outer = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in outer if getattr(o, "optimizer", None) is not None]


def _slots(optimizer) -> list[dict]:
    """Every dict holding a step count: per-parameter states with "step", then the param groups
    (with parameters) that hold one."""
    out = []
    for inner in _inner(optimizer):
        out += [st for st in getattr(inner, "state", {}).values() if "step" in st]
        out += [g for g in getattr(inner, "param_groups", []) if g.get("params") and "step" in g]
    return out


def read(optimizer) -> float | None:
    """Adam's step count; None before the first step.

    Args:
        optimizer: a Megatron optimizer (chained or not).
    Returns:
        the count as a float.
    """
    for slot in _slots(optimizer):
        return float(slot["step"])
    return None


def restore(optimizer, step: float) -> int:
    """Set Adam's step count to `step` wherever the inner optimizers keep one (a tensor keeps its
    dtype and device). Returns the number of places set (0: the optimizer has taken no step)."""
    slots = _slots(optimizer)
    for slot in slots:
        old = slot["step"]
        slot["step"] = torch.full_like(old, step) if isinstance(old, torch.Tensor) \
            else type(old)(step)
    return len(slots)
