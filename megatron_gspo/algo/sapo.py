"""SAPO: Soft Adaptive Policy Optimization (Gao et al., Qwen, arXiv 2511.20347).

SAPO replaces the hard clip of GRPO / GSPO by a smooth, temperature-controlled gate on the
token ratio r_it = pi_theta(y_it) / pi_old(y_it):

    f(r; tau) = (4 / tau) * sigmoid(tau * (r - 1))
    tau_it    = tau_pos if A_it > 0 else tau_neg            (tau_neg > tau_pos: negative tokens
                                                             are damped faster off-policy)
    J(theta)  = (1/N) * sum_i (1/|y_i|) * sum_t f(r_it; tau_it) * A_it

so L = -J, aggregated like GSPO (mean over the N sequences of the global mini-batch of each
sequence's token mean). The gradient of one term is w(r) * r * A * grad log pi with
w(r) = 4 * sigmoid(tau (r - 1)) * (1 - sigmoid(tau (r - 1))): w(1) = 1 (on-policy it is plain
policy gradient), and it decays smoothly as r leaves 1 instead of dropping to zero at a clip
boundary. Paper values: tau_pos = 1.0, tau_neg = 1.05.

Per-token advantages (GSPO-token style, turn-level) are native to SAPO: `advantages` may be
`[B]` (broadcast) or `[B, T]`; the temperature follows the sign of each token's advantage.

SAPO has no clip, so `clipped_tokens` is 0; `ratio_*` are token-level ratio statistics.
Numerics as in `losses`: float32, each token log-ratio bounded to [-bound, bound] before exp
(hits counted), rows without trainable tokens contribute exactly zero.
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

__all__ = ["sapo_loss", "sapo_gate"]


def sapo_gate(ratio, advantages, tau_pos, tau_neg):
    """f(r; tau) = (4 / tau) * sigmoid(tau * (r - 1)), tau by the sign of the advantage.

    Args:
        ratio, advantages: broadcastable tensors.
        tau_pos, tau_neg: temperatures (> 0) for positive and non-positive advantages.
    Returns:
        gate values, same shape as `ratio`.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, "
                         f"tau_neg={tau_neg}")
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=ratio.dtype),
                      torch.as_tensor(tau_neg, dtype=ratio.dtype))
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_loss(logprobs, old_logprobs, advantages, loss_mask, *, tau_pos=1.0, tau_neg=1.05,
              num_sequences=None, logratio_bound=LOGRATIO_BOUND):
    """SAPO loss L = -(1/N) sum_i (1/|y_i|) sum_t f(r_it; tau_it) A_it.

    Args:
        logprobs: `[B, T]` current-policy token log-probs (with grad).
        old_logprobs: `[B, T]` behaviour-policy token log-probs.
        advantages: `[B]` sequence or `[B, T]` token advantages.
        loss_mask: `[B, T]` 1 for trainable tokens.
        tau_pos, tau_neg: gate temperatures.
        num_sequences: divisor N (global count); default = local rows with a trainable token.
        logratio_bound: bound on each token log-ratio before exp.
    Returns:
        (loss scalar, stats dict as in `losses`).
    """
    log_ratio, mask, on = _prep(logprobs, old_logprobs, loss_mask)
    adv = _token_advantages(advantages, mask)  # [B, T]
    hits = _token_bound_hits(log_ratio, on, logratio_bound)
    ratio = torch.exp(log_ratio.clamp(-logratio_bound, logratio_bound))  # [B, T]
    gate = sapo_gate(ratio, adv, tau_pos, tau_neg)  # [B, T]
    per_tok = torch.where(on, -gate * adv, 0.0)  # [B, T]
    count = mask.sum(-1)  # [B]
    valid = count > 0
    n = valid.sum().clamp(min=1) if num_sequences is None else num_sequences
    loss = ((per_tok.sum(-1) / count.clamp(min=1.0)).sum() / n).to(torch.float32)
    none = torch.zeros_like(on)
    stats = _stats(low_tok=none, high_tok=none, trainable=mask.sum(),
                   sequences=valid.sum().to(torch.float32), ratio_vals=ratio, ratio_valid=on,
                   hits=hits)
    return loss, stats
