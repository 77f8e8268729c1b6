"""DAPO's two treatments of truncated responses (Yu et al., arXiv 2503.14476, sec. 3.4).

Overlong filtering: a response cut off at the generation limit (finish reason "length") has
no trustworthy reward (a correct line of reasoning may simply not have ended), so its loss is
masked; it still counts in its group's reward statistics.

Soft overlong punishment (eq. 13), a length-dependent term added to the reward, with
L_max the generation limit (`rollout.max_new_tokens`) and L_cache the punishment buffer:

    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                  if L_max < |y|

scaled by a factor (DAPO: 1). The reward becomes r + factor * R_length(y) before the group
advantages are computed.
"""

from __future__ import annotations

__all__ = ["soft_overlong_penalty", "apply_overlong"]


def soft_overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
    """factor * R_length for a response of `length` tokens (see the module docstring).

    Args:
        length: response tokens |y|.
        max_length: L_max.
        buffer: L_cache (1 <= buffer <= max_length).
        factor: scale of the term.
    Returns:
        a value in [-factor, 0].
    """
    if not 1 <= buffer <= max_length:
        raise ValueError(f"overlong buffer {buffer} must lie in [1, {max_length}]")
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return factor * (start - length) / buffer
    return -factor


def apply_overlong(samples, *, max_length: int, buffer: int = 0, factor: float = 1.0,
                   filter_truncated: bool = False) -> dict:
    """Soft punishment on the rewards (buffer > 0) and filtering of truncated responses.

    Args:
        samples: `Sample`s with `reward`, `response_ids`, `finish_reason`, `loss_mask`
            (changed in place: rewards before advantages; truncated responses get loss mask 0
            and, like every untrained token, engine log-prob 0).
        max_length, buffer, factor: as in `soft_overlong_penalty` (buffer 0: no punishment).
        filter_truncated: mask the loss of responses with finish reason "length".
    Returns:
        metrics: `reward/overlong_penalty_mean`, `reward/overlong_punished_share`,
        `reward/overlong_filtered_share` (each present when its option is on).
    """
    m: dict = {}
    n = max(len(samples), 1)
    if buffer > 0:
        pens = [soft_overlong_penalty(len(s.response_ids), max_length, buffer, factor)
                for s in samples]
        for s, p in zip(samples, pens, strict=True):
            s.reward = float(s.reward) + p
        m["reward/overlong_penalty_mean"] = sum(pens) / n
        m["reward/overlong_punished_share"] = sum(p < 0 for p in pens) / n
    if filter_truncated:
        cut = [s for s in samples if s.finish_reason == "length" and s.num_trainable > 0]
        for s in cut:  # untrained tokens carry engine log-prob 0 (`check_engine_logprobs`)
            s.loss_mask = [0] * len(s.loss_mask)
            if s.rollout_logprobs is not None:
                s.rollout_logprobs = [0.0] * len(s.rollout_logprobs)
        m["reward/overlong_filtered_share"] = len(cut) / n
    return m
