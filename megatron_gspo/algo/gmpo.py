"""GMPO: Geometric-Mean Policy Optimization (Zhao et al., arXiv 2507.20673).

GMPO maximises the geometric mean of the token-level clipped objectives of a sequence instead
of their arithmetic mean:

    J(theta) = (1/N) * sum_i  [ prod_t | min(r_it A_i, clip(r_it, e^-eps_low, e^eps_high) A_i) |
                              ]^(1/|y_i|) * sign(A_i)

In log space, with l_it = log r_it and sg = sign(A_i), min(r A, clip(r) A) for a fixed sign of
A picks l~_it = sg * min(sg * l_it, sg * clip(l_it, -eps_low, eps_high)), so

    rho_i    = exp( (1/|y_i|) * sum_t l~_it )
    L        = -(1/N) * sum_i A_i * rho_i

(|A| * sign(A) = A). The clip is token-wise in LOG space (paper: eps_low = eps_high = 0.4, i.e.
the range (e^-0.4, e^0.4)), the ratio is a geometric mean like GSPO's, and the loss is one term
per sequence with the global sequence count N as divisor.

Per-token advantages: the paper defines GMPO for one advantage per sequence (the product runs
over the tokens of a sequence scored as a whole); `[B, T]` advantages are rejected.
`clipped_tokens*` count tokens whose clipped log-ratio is the active branch.
"""

from __future__ import annotations

import torch

from megatron_gspo.algo.losses import LOGRATIO_BOUND, _prep, _stats, _token_bound_hits

__all__ = ["gmpo_loss"]


def gmpo_loss(logprobs, old_logprobs, advantages, loss_mask, *, eps_low=0.4, eps_high=0.4,
              num_sequences=None, logratio_bound=LOGRATIO_BOUND):
    """GMPO loss L = -(1/N) sum_i A_i exp(mean_t l~_it).

    Args:
        logprobs: `[B, T]` current-policy token log-probs (with grad).
        old_logprobs: `[B, T]` behaviour-policy token log-probs.
        advantages: `[B]` sequence advantages.
        loss_mask: `[B, T]`.
        eps_low, eps_high: log-space clip range [-eps_low, eps_high] of each token log-ratio.
        num_sequences: divisor N (global count); default = local rows with a trainable token.
        logratio_bound: bound on each token log-ratio (before the clip) and on the mean.
    Returns:
        (loss scalar, stats dict as in `losses`).
    """
    log_ratio, mask, on = _prep(logprobs, old_logprobs, loss_mask)
    adv = advantages.to(torch.float32)
    if adv.dim() != 1:
        raise ValueError("gmpo_loss: GMPO is defined for one advantage per sequence; got "
                         f"advantages of shape {tuple(adv.shape)}")
    if adv.shape[0] != log_ratio.shape[0]:
        raise ValueError(f"advantages has {adv.shape[0]} rows for {log_ratio.shape[0]} sequences")
    hits = _token_bound_hits(log_ratio, on, logratio_bound)
    lr = log_ratio.clamp(-logratio_bound, logratio_bound)  # [B, T]
    sg = torch.where(adv >= 0, 1.0, -1.0)[:, None]  # [B, 1]
    clipped = lr.clamp(-eps_low, eps_high)  # [B, T]
    tilde = sg * torch.minimum(sg * lr, sg * clipped)  # [B, T]
    tilde = torch.where(on, tilde, 0.0)
    count = mask.sum(-1)  # [B]
    valid = count > 0
    rho = torch.exp(tilde.sum(-1) / count.clamp(min=1.0))  # [B]
    per_seq = torch.where(valid, -adv * rho, 0.0)  # [B]
    n = valid.sum().clamp(min=1) if num_sequences is None else num_sequences
    loss = (per_seq.sum() / n).to(torch.float32)
    d = lr.detach()
    pos, neg = (adv > 0)[:, None], (adv < 0)[:, None]
    high = pos & (d > eps_high) & on
    low = neg & (d < -eps_low) & on
    stats = _stats(low_tok=low, high_tok=high, trainable=mask.sum(),
                   sequences=valid.sum().to(torch.float32), ratio_vals=rho, ratio_valid=valid,
                   hits=hits)
    return loss, stats
