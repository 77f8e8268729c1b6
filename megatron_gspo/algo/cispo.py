"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585, eqs. 4-5).

Instead of clipping the surrogate (which zeroes the gradient of clipped tokens), CISPO clips
the importance-sampling weight and stops its gradient, so every token keeps a REINFORCE-style
gradient:

    r_it     = pi_theta(y_it) / pi_old(y_it)
    r^_it    = clip(r_it, 1 - eps_low, 1 + eps_high)
    J(theta) = (1 / sum_i |y_i|) * sum_i sum_t sg(r^_it) * A_it * log pi_theta(y_it)

token-mean over ALL trainable tokens of the global mini-batch (divisor `num_tokens`). The paper
sets no lower bound (eps_low = 1 makes the lower clip 0, which never binds) and tunes only
eps_high.

Value convention: the returned loss is -(1/N_tok) sum sg(r^) A * exp(log pi - sg(log pi)),
whose VALUE is the weighted advantage -(1/N_tok) sum sg(r^) A (a meaningful number, free of the
arbitrary offset sum A log pi) and whose GRADIENT equals the paper's
-(1/N_tok) sum sg(r^) A grad log pi exactly.

Per-token advantages: the objective is token-level, so `[B, T]` advantages are native.
`clipped_tokens*` count tokens whose weight was truncated (their gradient still flows).
"""

from __future__ import annotations

import torch

from megatron_gspo.algo.losses import (
    LOGRATIO_BOUND,
    _prep,
    _stats,
    _token_advantages,
    _token_bound_hits,
)

__all__ = ["cispo_loss"]


def cispo_loss(logprobs, old_logprobs, advantages, loss_mask, *, eps_low=1.0, eps_high=0.28,
               num_tokens=None, logratio_bound=LOGRATIO_BOUND):
    """CISPO loss, token-mean with the truncated, stop-gradient IS weight.

    Args:
        logprobs: `[B, T]` current-policy token log-probs (with grad).
        old_logprobs: `[B, T]` behaviour-policy token log-probs.
        advantages: `[B]` or `[B, T]`.
        loss_mask: `[B, T]`.
        eps_low, eps_high: weight clipped to [1 - eps_low, 1 + eps_high] (eps_low = 1: none).
        num_tokens: divisor (global trainable tokens); default = local count.
        logratio_bound: bound on each token log-ratio before exp.
    Returns:
        (loss scalar, stats dict as in `losses`).
    """
    log_ratio, mask, on = _prep(logprobs, old_logprobs, loss_mask)
    adv = _token_advantages(advantages, mask)  # [B, T]
    hits = _token_bound_hits(log_ratio, on, logratio_bound)
    ratio = torch.exp(log_ratio.detach().clamp(-logratio_bound, logratio_bound))  # [B, T]
    weight = ratio.clamp(max(1.0 - eps_low, 0.0), 1.0 + eps_high)  # [B, T], no grad
    lp = torch.where(on, logprobs.float(), 0.0)  # [B, T]
    unit = torch.exp(lp - lp.detach())  # value 1, gradient d log pi
    per_tok = torch.where(on, -weight * adv * unit, 0.0)  # [B, T]
    n = mask.sum().clamp(min=1.0) if num_tokens is None else num_tokens
    loss = (per_tok.sum() / n).to(torch.float32)
    high = (ratio > 1.0 + eps_high) & on
    low = (ratio < 1.0 - eps_low) & on
    stats = _stats(low_tok=low, high_tok=high, trainable=mask.sum(),
                   sequences=(mask.sum(-1) > 0).sum().to(torch.float32), ratio_vals=ratio,
                   ratio_valid=on, hits=hits)
    return loss, stats
