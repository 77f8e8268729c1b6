"""Advantages for multi-turn episodes, expanded to per-token advantages for GSPO-token.

Two modes:
- episode level (GSPO): one group-normalised advantage per episode,
  A_i = (R_i - mean_g R) / (std_g R + eps), copied to every model token of the episode;
- turn level: per-turn rewards r_ik (k = turn index) turned into discounted returns
  G_ik = sum_{j >= k} gamma^(j - k) r_ij (later turns' rewards discounted), normalised across
  the G episodes of the same prompt, and copied to the model tokens of turn k.
  Normalisation "pooled" uses the mean/std of all turns of all episodes in the group;
  "per_turn" uses, for each turn index k, the episodes of the group that have a turn k.

Tokens with loss mask 0 (tool / environment text) get advantage 0. Std is the unbiased sample
std; a group with a single value gets std 0 (advantage 0 when centred). Pure torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NORMALIZATIONS = ("pooled", "per_turn")


def discounted_returns(
    turn_rewards: torch.Tensor, turn_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Return-to-go per turn.

    Args:
        turn_rewards: [B, K] reward of each turn (padding anywhere turn_mask is 0).
        turn_mask: [B, K] 1 for real turns (a prefix of each row).
        gamma: discount in [0, 1] applied to later turns' rewards.
    Returns:
        [B, K] float32 G_k = sum_{j >= k} gamma^(j-k) r_j over real turns; 0 on padding.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"turn discount gamma={gamma} must be in [0, 1]")
    r = turn_rewards.float() * turn_mask.float()  # [B, K]
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)  # [B]
    for k in range(r.shape[1] - 1, -1, -1):
        running = r[:, k] + gamma * running
        out[:, k] = running
    return out * turn_mask.float()


def _normalize(values: torch.Tensor, scale_by_std: bool, eps: float) -> torch.Tensor:
    """Centre (and scale) a 1-D tensor."""
    mean = values.mean()
    if not scale_by_std:
        return values - mean
    if values.numel() < 2:
        return torch.zeros_like(values)
    denom = values.std() + eps
    if denom <= 0:  # equal values and eps = 0
        return torch.zeros_like(values)
    return (values - mean) / denom


def group_normalize(
    values: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalization: str = "pooled",
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Normalise values within each prompt group.

    Args:
        values: [B, K] per-turn values (K = 1 for episode level).
        mask: [B, K] 1 where a value exists.
        group_ids: [B] prompt group of each episode.
        normalization: "pooled" or "per_turn" (see module docstring).
        scale_by_std: divide by std + eps (False: only centre, Dr. GRPO style).
        eps: added to the std.
    Returns:
        [B, K] float32 normalised values, 0 where mask is 0.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"turn advantage normalization {normalization!r} not in {NORMALIZATIONS}")
    values = values.float()
    m = mask.bool()
    out = torch.zeros_like(values)
    for g in torch.unique(group_ids):
        rows = group_ids == g  # [B]
        if normalization == "pooled":
            sel = m & rows[:, None]
            out[sel] = _normalize(values[sel], scale_by_std, eps)
        else:
            for k in range(values.shape[1]):
                sel = m[:, k] & rows
                if sel.any():
                    out[sel, k] = _normalize(values[sel, k], scale_by_std, eps)
    return out


def turn_level_advantages(
    turn_rewards: torch.Tensor,
    turn_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    gamma: float = 1.0,
    normalization: str = "pooled",
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Turn-level advantages: discounted returns, normalised within prompt groups.

    Args:
        turn_rewards: [B, K]; turn_mask: [B, K]; group_ids: [B].
        gamma, normalization, scale_by_std, eps: see `discounted_returns`, `group_normalize`.
    Returns:
        [B, K] advantage of each turn (0 on padding).
    """
    returns = discounted_returns(turn_rewards, turn_mask, gamma)  # [B, K]
    return group_normalize(
        returns,
        turn_mask,
        group_ids,
        normalization=normalization,
        scale_by_std=scale_by_std,
        eps=eps,
    )


def episode_level_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GSPO group advantages of whole episodes.

    Args:
        rewards: [B] episode rewards; group_ids: [B].
    Returns:
        [B] float32 advantages.
    """
    ones = torch.ones(rewards.shape[0], 1)
    return group_normalize(
        rewards.float()[:, None], ones, group_ids, scale_by_std=scale_by_std, eps=eps
    )[:, 0]


def expand_turn_advantages(
    turn_adv: torch.Tensor, turn_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Per-token advantages from per-turn advantages.

    Args:
        turn_adv: [B, K] advantage of each turn.
        turn_ids: [B, T] turn index of each response token (any value where loss_mask is 0).
        loss_mask: [B, T] 1 on model tokens.
    Returns:
        [B, T] float32: turn_adv[b, turn_ids[b, t]] on model tokens, 0 elsewhere.
    """
    mask = loss_mask.bool()
    if mask.any() and (turn_ids[mask].min() < 0 or turn_ids[mask].max() >= turn_adv.shape[1]):
        raise ValueError(f"turn_ids out of range [0, {turn_adv.shape[1]}) on a model token")
    idx = torch.where(mask, turn_ids.long(), torch.zeros_like(turn_ids, dtype=torch.long))
    return torch.gather(turn_adv.float(), 1, idx) * mask.float()


def expand_episode_advantages(adv: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Constant per-token advantages: [B] -> [B, T], 0 where loss_mask is 0."""
    return adv.float()[:, None] * loss_mask.float()


def pad_turn_rewards(turn_rewards: Sequence[Sequence[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-episode turn rewards -> ([B, K] rewards, [B, K] mask)."""
    k = max((len(r) for r in turn_rewards), default=0)
    k = max(k, 1)
    vals = torch.zeros(len(turn_rewards), k)
    mask = torch.zeros(len(turn_rewards), k)
    for i, r in enumerate(turn_rewards):
        if len(r):
            vals[i, : len(r)] = torch.tensor([float(x) for x in r])
            mask[i, : len(r)] = 1.0
    return vals, mask


def assign_multiturn_advantages(
    samples: Sequence,
    *,
    mode: str = "turn",
    gamma: float = 1.0,
    normalization: str = "pooled",
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> None:
    """Fill `sample.advantage` with per-token lists for a batch of episodes (in place).

    Args:
        samples: Samples with loss_mask, turn_ids, turn_rewards (turn mode) or reward
            (episode mode), and group_index.
        mode: "turn" or "episode".
        gamma, normalization, scale_by_std, eps: see `turn_level_advantages`.
    """
    if mode not in ("turn", "episode"):
        raise ValueError(f"multi-turn advantage mode {mode!r} not in ('turn', 'episode')")
    groups = torch.tensor([s.group_index for s in samples], dtype=torch.long)
    if mode == "episode":
        for s in samples:
            if s.reward is None:
                raise ValueError(f"sample {s.index}: reward is missing")
        adv = episode_level_advantages(
            torch.tensor([float(s.reward) for s in samples]),
            groups,
            scale_by_std=scale_by_std,
            eps=eps,
        )
        for s, a in zip(samples, adv.tolist(), strict=False):
            s.advantage = [a * m for m in s.loss_mask]
        return
    for s in samples:
        if s.turn_rewards is None or s.turn_ids is None:
            raise ValueError(f"sample {s.index}: turn mode needs turn_rewards and turn_ids")
    rewards, tmask = pad_turn_rewards([s.turn_rewards for s in samples])
    tadv = turn_level_advantages(
        rewards,
        tmask,
        groups,
        gamma=gamma,
        normalization=normalization,
        scale_by_std=scale_by_std,
        eps=eps,
    )
    for i, s in enumerate(samples):
        if not s.response_ids:
            s.advantage = []
            continue
        tok = expand_turn_advantages(
            tadv[i : i + 1],
            torch.tensor([s.turn_ids], dtype=torch.long),
            torch.tensor([s.loss_mask]),
        )
        s.advantage = tok[0].tolist()
