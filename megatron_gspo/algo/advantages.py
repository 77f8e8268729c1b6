"""Group-relative advantages for GSPO / GRPO (arXiv 2507.18071, 2402.03300).

Rewards of the G responses to one prompt are normalised within the group: A_i = (r_i - mean) /
(std + eps), or only mean-centred (`scale="none"`, Dr. GRPO, arXiv 2503.20783). Turn-level
advantages for multi-turn episodes live in `turn_advantages.py`.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "zero_variance_groups"]


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    r = rewards.reshape(-1).to(torch.float32)
    if r.numel() % group_size != 0:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    return r.view(-1, group_size)  # [P, G]


def group_advantages(rewards, group_size, *, scale="std", eps=1e-6):
    """Group-normalised advantages.

    Args:
        rewards: `[N]` rewards ordered group by group (N = P * group_size).
        group_size: G, responses per prompt.
        scale: "std" divides by the group's unbiased std + eps; "none" only subtracts the mean.
        eps: added to the std (a group with unequal rewards has std > 0, so eps = 0 is safe).
    Returns:
        `[N]` float32 advantages; a group with equal rewards (or G = 1) gets exact zeros,
        never NaN.
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale: expected 'std' or 'none', got {scale!r}")
    r = _groups(rewards, group_size)  # [P, G]
    # all-equal groups carry no signal: exactly 0 (the float mean of equal values may differ
    # from them in the last bit, and 0 / (0 + eps) is NaN when eps = 0)
    flat = (r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values)  # [P, 1]
    centred = torch.where(flat, torch.zeros_like(r), r - r.mean(dim=1, keepdim=True))
    if scale == "none" or group_size == 1:
        return centred.reshape(-1)
    std = r.std(dim=1, unbiased=True, keepdim=True)  # [P, 1]
    return torch.where(flat, centred, centred / (std + eps)).reshape(-1)


def zero_variance_groups(rewards, group_size, *, tol=0.0):
    """Which groups have (near) identical rewards and so carry no learning signal.

    Args:
        rewards: `[N]` rewards ordered group by group.
        group_size: G.
        tol: max - min at or below which a group counts as zero-variance.
    Returns:
        `[P]` bool tensor.
    """
    r = _groups(rewards, group_size)
    return (r.max(dim=1).values - r.min(dim=1).values) <= tol
