"""KL penalty to a frozen reference policy and entropy bonus (pure torch).

Estimators of KL(pi_theta || pi_ref) from tokens sampled by the policy (Schulman, "Approximating
KL divergence", 2020), with the per-token log-ratio d_t = log pi_theta(y_t) - log pi_ref(y_t):

    k1(d) = d
    k2(d) = d^2 / 2
    k3(d) = exp(-d) - 1 + d            (unbiased, non-negative, low variance)

Sequence KL of response i over its trainable tokens (loss mask = 1), |y_i| = their count:

    KL_i = (1/|y_i|) * sum_t k(d_it)           (0 for a row without trainable tokens)

In the loss (`kl_in: loss`), the term is aggregated like the policy term it is added to:

    GSPO / GSPO-token / GRPO seq-mean-token-mean:  L_kl = beta * (1/N) * sum_i KL_i
    GRPO token-mean (DAPO), CISPO:                 L_kl = beta * (1/N_tok) * sum_i sum_t k(d_it)
    GRPO seq-mean-token-sum-norm (Dr. GRPO):       L_kl = beta * (1/(N L)) * sum_i sum_t k(d_it)
    SAPO, GMPO: as GSPO (sequence mean of token means).

with N (N_tok) the global number of sequences (trainable tokens) of the mini-batch, so micro-
batches and ranks add up to the same global mean as the policy loss.

In the reward (`kl_in: reward`), with pi_theta = pi_old (the sampling policy) and no gradient:

    r_i <- r_i - beta * KL_i           before group advantages are computed.

Entropy bonus: H_t = -sum_v p_v log p_v of the token distribution (softmax(logits / T)),
aggregated like the policy term (per-sequence mean of token entropies over N sequences, or
token mean over N_tok) and SUBTRACTED from the loss: L_ent = -alpha * mean(H).

Metrics: `kl/mean` and `kl/max` are the sequence KL_i of the chosen estimator evaluated with the
sampling policy's log-probs (pi_old), i.e. the plain Monte-Carlo estimate under the distribution
the tokens came from, never weighted by the current/old ratio.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("k1", "k2", "k3")

__all__ = ["ESTIMATORS", "token_kl", "sequence_kl", "kl_loss", "entropy_loss", "kl_reward"]


def token_kl(logprobs, ref_logprobs, estimator: str = "k3"):
    """Per-token KL estimate k(d), d = logprobs - ref_logprobs.

    Args:
        logprobs: `[B, T]` policy log-probs (may carry gradients).
        ref_logprobs: `[B, T]` reference log-probs (treated as constants).
        estimator: "k1" | "k2" | "k3".
    Returns:
        `[B, T]` float32 estimates (values at masked positions are meaningless).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"kl estimator: expected one of {ESTIMATORS}, got {estimator!r}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)}, ref_logprobs "
                         f"{tuple(ref_logprobs.shape)}")
    d = logprobs.float() - ref_logprobs.float().detach()  # [B, T]
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.expm1(-d) + d


def _masked(values, loss_mask):
    on = loss_mask > 0  # [B, T]
    return torch.where(on, values, torch.zeros((), dtype=values.dtype, device=values.device)), on


def sequence_kl(logprobs, ref_logprobs, loss_mask, estimator: str = "k3"):
    """Sequence KL_i = mean over trainable tokens of k(d_it).

    Args:
        logprobs, ref_logprobs, loss_mask: `[B, T]`; masked positions may hold garbage.
        estimator: "k1" | "k2" | "k3".
    Returns:
        `(kl [B], token_count [B])`; rows without trainable tokens give 0.
    """
    if loss_mask.shape != logprobs.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} != logprobs "
                         f"{tuple(logprobs.shape)}")
    on = loss_mask > 0
    lp = torch.where(on, logprobs.float(), 0.0)  # garbage (-inf) never reaches the estimator
    ref = torch.where(on, ref_logprobs.float(), 0.0)
    k, _ = _masked(token_kl(lp, ref, estimator), loss_mask)  # [B, T]
    count = on.to(torch.float32).sum(-1)  # [B]
    return k.sum(-1) / count.clamp(min=1.0), count


def _aggregate(token_values, loss_mask, aggregation, num_sequences, num_tokens,
               norm_length=None):
    vals, on = _masked(token_values, loss_mask)  # [B, T]
    count = on.to(torch.float32).sum(-1)  # [B]
    if aggregation == "token-mean":
        n = count.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        return vals.sum() / n
    n = (count > 0).sum().clamp(min=1) if num_sequences is None else num_sequences
    if aggregation == "seq-mean-token-sum-norm":  # Dr. GRPO: token sums over N * L_norm
        if norm_length is None or norm_length <= 0:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_length > 0")
        return vals.sum() / (n * norm_length)
    if aggregation != "seq-mean-token-mean":
        raise ValueError(f"aggregation: expected 'seq-mean-token-mean', 'token-mean' or "
                         f"'seq-mean-token-sum-norm', got {aggregation!r}")
    return (vals.sum(-1) / count.clamp(min=1.0)).sum() / n


def kl_loss(logprobs, ref_logprobs, loss_mask, *, coef: float, estimator: str = "k3",
            aggregation: str = "seq-mean-token-mean", num_sequences=None, num_tokens=None,
            norm_length=None):
    """beta * aggregated KL to the reference (see module docstring).

    Args:
        logprobs: `[B, T]` current-policy log-probs (with grad).
        ref_logprobs: `[B, T]` reference log-probs.
        loss_mask: `[B, T]` 1 for trainable tokens.
        coef: beta (kl_coef).
        estimator: "k1" | "k2" | "k3".
        aggregation: "seq-mean-token-mean" (GSPO, GSPO-token, GRPO default, SAPO, GMPO),
            "token-mean" (DAPO, CISPO) or "seq-mean-token-sum-norm" (Dr. GRPO).
        num_sequences, num_tokens: global divisors; default = local counts.
        norm_length: L_norm of "seq-mean-token-sum-norm".
    Returns:
        float32 scalar.
    """
    on = loss_mask > 0
    lp = torch.where(on, logprobs.float(), 0.0)  # [B, T]
    ref = torch.where(on, ref_logprobs.float(), 0.0)
    k = token_kl(lp, ref, estimator)  # [B, T]
    return (coef * _aggregate(k, loss_mask, aggregation, num_sequences, num_tokens,
                              norm_length)).float()


def entropy_loss(entropy, loss_mask, *, coef: float, aggregation: str = "seq-mean-token-mean",
                 num_sequences=None, num_tokens=None, norm_length=None):
    """-alpha * aggregated token entropy (a bonus: lowers the loss when entropy is high).

    Args:
        entropy: `[B, T]` token entropies (with grad).
        loss_mask: `[B, T]`.
        coef: alpha (entropy_coef).
        aggregation, num_sequences, num_tokens, norm_length: as in `kl_loss`.
    Returns:
        float32 scalar.
    """
    ent = torch.where(loss_mask > 0, entropy.float(), 0.0)  # [B, T]
    return (-coef * _aggregate(ent, loss_mask, aggregation, num_sequences, num_tokens,
                               norm_length)).float()


def kl_reward(rewards, old_logprobs, ref_logprobs, loss_mask, *, coef: float,
              estimator: str = "k3"):
    """Rewards with the sequence KL penalty subtracted (`kl_in: reward`).

    Args:
        rewards: `[B]` scalar rewards.
        old_logprobs: `[B, T]` sampling-policy log-probs.
        ref_logprobs, loss_mask: `[B, T]`.
        coef: beta.
        estimator: "k1" | "k2" | "k3".
    Returns:
        `([B] penalised rewards, [B] sequence KL)`, both detached float32.
    """
    with torch.no_grad():
        kl, _ = sequence_kl(old_logprobs, ref_logprobs, loss_mask, estimator)  # [B]
        return rewards.float() - coef * kl, kl
