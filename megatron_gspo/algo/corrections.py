"""Corrections of the engine/learner mismatch and of stale samples, next to the sequence mask
and TIS of `precision.apply_correction` (which dispatches here).

Notation: for a sample drawn by the inference engine, k_t = pi_learner(y_t) / pi_engine(y_t)
per token (both at the weights that generated it) and d_i = (1/|y_i|) sum_t log k_t, the
length-normalised sequence log-mismatch of `precision.sequence_mismatch`.

IcePop (Ling team, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model",
arXiv 2510.18855): tokens whose probability ratio leaves a band are removed from the gradient,

    M(k_t) = 1 if alpha <= k_t <= beta else 0        (paper: alpha = 0.5, beta = 5)

applied here as a token loss mask. (The paper also multiplies kept tokens by k_t; that in-band
reweighting is not applied: for GSPO's sequence-level ratio a per-token weight has no place.)

MIS, masked importance sampling (Yao et al., "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", 2025; Liu et al., "When Speed Kills Stability", 2025): instead of
truncating the weight at C (TIS), a sample whose weight exceeds C is dropped,

    w_i = rho_i if rho_i <= C else 0,   rho_i = exp(d_i)

The sequence weight is the GEOMETRIC per-token mean exp(d_i), the quantity GSPO's own ratio is
built from, never exp(sum_t log k_t), whose value explodes with the length (a 1000-token
response with log k = 1e-3 per token would get e^1 instead of e^1e-3).

Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, sec. 3.1): in each training
forward, a sequence with a negative advantage whose KL from the sampling policy exceeds delta
is masked,

    M_i = 0 if A_i < 0 and (1/|y_i|) sum_t log(pi_old(y_t) / pi_theta(y_t)) > delta else 1

with pi_old the sampling (engine) log-probs the loss uses as pi_old and pi_theta the current
policy (no gradient through the mask). The loss keeps its divisor (N sequences or tokens), as
in the paper, and the KL / entropy terms keep their mask (the paper masks the policy term).
With per-token advantages the token test A_it < 0 replaces A_i < 0 (identical when A_it = A_i).
"""

from __future__ import annotations

import torch

__all__ = ["icepop_token_mask", "mis_weights", "offpolicy_sequence_mask"]


def icepop_token_mask(token_log_ratio, loss_mask, *, low=0.5, high=5.0):
    """IcePop: drop trainable tokens with k_t = exp(log k_t) outside [low, high].

    Args:
        token_log_ratio: `[B, T]` log pi_learner - log pi_engine.
        loss_mask: `[B, T]`.
        low, high: the band [alpha, beta] (0 < low < 1 < high).
    Returns:
        (new loss mask like `loss_mask`, `[B, T]` bool of the dropped tokens).
    """
    if not 0 < low < 1 < high:
        raise ValueError(f"IcePop band: expected 0 < low < 1 < high, got [{low}, {high}]")
    on = loss_mask > 0
    lr = token_log_ratio.detach().to(torch.float64)
    out = (lr < torch.log(torch.tensor(low, dtype=torch.float64))) | \
        (lr > torch.log(torch.tensor(high, dtype=torch.float64)))
    drop = out & on  # [B, T]
    return loss_mask * (~drop).to(loss_mask.dtype), drop


def mis_weights(mismatch, loss_mask, *, cap=2.0):
    """MIS: sequence weight exp(d_i) when at most `cap`, else the sequence is dropped.

    Args:
        mismatch: `[B]` d_i (mean per-token log-mismatch).
        loss_mask: `[B, T]`.
        cap: C.
    Returns:
        (`[B]` float32 weights, 0 where dropped; `[B]` bool dropped rows with trainable tokens).
    """
    d = mismatch.detach().to(torch.float32)
    w = torch.exp(d.clamp(max=torch.log(torch.tensor(cap)).item() + 1.0))  # [B]
    drop = (w > cap) & (loss_mask.sum(-1) > 0)
    return torch.where(drop, 0.0, w), drop


def offpolicy_sequence_mask(logprobs, old_logprobs, advantages, loss_mask, *, delta):
    """DeepSeek-V3.2 off-policy sequence mask (see the module docstring).

    Args:
        logprobs: `[B, T]` current-policy log-probs (used detached).
        old_logprobs: `[B, T]` sampling-policy log-probs.
        advantages: `[B]` or `[B, T]`.
        loss_mask: `[B, T]`.
        delta: KL threshold.
    Returns:
        (new loss mask, `[B]` bool: rows that lost a trainable token, `[B]` float32 KL_i).
    """
    on = loss_mask > 0
    diff = torch.where(on, old_logprobs.detach().float() - logprobs.detach().float(), 0.0)
    count = on.sum(-1).to(torch.float32)  # [B]
    kl = diff.sum(-1) / count.clamp(min=1.0)  # [B]
    adv = advantages.detach().to(torch.float32)
    neg = (adv < 0)[:, None] if adv.dim() == 1 else adv < 0  # [B, 1] or [B, T]
    drop = (kl > delta)[:, None] & neg & on  # [B, T]
    return loss_mask * (~drop).to(loss_mask.dtype), drop.any(-1), kl
