"""Policy-gradient losses: GSPO, GSPO-token (Group Sequence Policy Optimization, Zheng et al.,
arXiv 2507.18071) and the GRPO baseline (DeepSeekMath, arXiv 2402.03300; DAPO token-mean
aggregation, arXiv 2503.14476; Dr. GRPO's constant-length aggregation, arXiv 2503.20783:
L = -(1/(N * L_norm)) sum_i sum_t min(r_it A_i, clip(r_it) A_i), no 1/|y_i|, with L_norm a
fixed generation budget). SAPO, CISPO and GMPO live in `sapo.py`, `cispo.py`, `gmpo.py`.

All losses take `[B, T]` tensors of per-token log-probabilities under the current policy
(`logprobs`, carrying gradients) and the behaviour policy (`old_logprobs`), a `[B, T]` loss mask
(1 = trainable token) and advantages, and return `(loss, stats)`.

Normalisation is explicit so a global mini-batch can be spread over micro-batches and ranks:
the loss is the SUM of per-sequence (or per-token) terms divided by `num_sequences`
(`num_tokens` for token-mean GRPO). With the default (None) the divisor is the local count.

`stats` holds detached float32 scalars. Ratios (`clip_fraction*`, `ratio_mean`) are local;
the sum-type entries (`clipped_tokens`, `clipped_tokens_low`, `clipped_tokens_high`,
`trainable_tokens`, `sequences`, `ratio_sum`, `ratio_count`, `logratio_bound_hits`) can be
all-reduced across micro-batches and ranks, `ratio_min`/`ratio_max` with MIN/MAX, and turned into
global fractions with `finalize_stats`.

Numerics: everything is computed in float32; log-ratios are bounded to [-bound, bound] before
`exp` (the number of bound hits is reported); a row without trainable tokens contributes exactly
zero and never a NaN.
"""

from __future__ import annotations

import torch

LOGRATIO_BOUND = 20.0
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")

__all__ = [
    "LOGRATIO_BOUND",
    "AGGREGATIONS",
    "gspo_loss",
    "gspo_token_loss",
    "grpo_loss",
    "sequence_log_ratio",
    "finalize_stats",
]


def _prep(logprobs, old_logprobs, loss_mask):
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs.shape)}, old_logprobs "
            f"{tuple(old_logprobs.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    if logprobs.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got {logprobs.dim()} dims")
    mask = loss_mask.to(torch.float32)  # [B, T]
    on = mask > 0
    # Masked positions may hold garbage (-inf, padding): zero them before any arithmetic.
    log_ratio = torch.where(
        on, logprobs.float() - old_logprobs.float().detach(), torch.zeros((), device=mask.device)
    )  # [B, T]
    return log_ratio, mask, on


def sequence_log_ratio(logprobs, old_logprobs, loss_mask):
    """Length-normalised sequence log-ratio (1/|y_i|) * sum_t (logp - old_logp).

    Args:
        logprobs, old_logprobs, loss_mask: `[B, T]`.
    Returns:
        `(seq_log_ratio [B], token_count [B])`; rows without trainable tokens give 0.
    """
    log_ratio, mask, _ = _prep(logprobs, old_logprobs, loss_mask)
    count = mask.sum(-1)  # [B]
    return log_ratio.sum(-1) / count.clamp(min=1.0), count


def _token_advantages(advantages, mask):
    """Advantages as float32 `[B, T]`: a `[B]` tensor is broadcast over tokens; another shape
    than `mask`'s is a ValueError."""
    adv = advantages.to(torch.float32)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(mask)
    if adv.shape != mask.shape:
        raise ValueError(f"advantages shape {tuple(adv.shape)} != loss_mask {tuple(mask.shape)}")
    return adv  # [B, T]


def _token_bound_hits(log_ratio, on, bound):
    """How many trainable token log-ratios exceed `bound` (float32 scalar, for `_stats`)."""
    return ((log_ratio.detach().abs() > bound) & on).sum().to(torch.float32)


def _bounded_seq_log_ratio(log_ratio, count, valid, bound):
    """Mean log-ratio per row bounded to [-bound, bound], and how many valid rows hit the bound.

    Args:
        log_ratio: `[B, T]` (zero where masked); count: `[B]` trainable tokens; valid: `[B]`.
    Returns:
        (`[B]` bounded mean log-ratio, float32 hit count).
    """
    raw = log_ratio.sum(-1) / count.clamp(min=1.0)  # [B]
    hits = (raw.detach().abs() > bound)[valid].sum().to(torch.float32)
    return raw.clamp(-bound, bound), hits


def _clip_masks(ratio, adv, eps_low, eps_high):
    """Where the clipped branch of min(rA, clip(r)A) is active and differs from rA."""
    high = (adv > 0) & (ratio > 1.0 + eps_high)
    low = (adv < 0) & (ratio < 1.0 - eps_low)
    return low, high


def _surrogate(ratio, adv, eps_low, eps_high):
    """-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A), elementwise."""
    return -torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)


def _stats(*, low_tok, high_tok, trainable, sequences, ratio_vals, ratio_valid, hits):
    f32 = torch.float32
    clipped_low = low_tok.sum().to(f32)
    clipped_high = high_tok.sum().to(f32)
    denom = trainable.clamp(min=1.0)
    rv = ratio_vals.detach().to(f32)[ratio_valid]
    has = rv.numel() > 0
    zero = torch.zeros((), dtype=f32, device=ratio_vals.device)
    return {
        "clip_fraction": (clipped_low + clipped_high) / denom,
        "clip_fraction_low": clipped_low / denom,
        "clip_fraction_high": clipped_high / denom,
        "ratio_mean": rv.mean() if has else zero + 1.0,
        "ratio_min": rv.min() if has else zero + 1.0,
        "ratio_max": rv.max() if has else zero + 1.0,
        "logratio_bound_hits": hits.detach(),
        "clipped_tokens": clipped_low + clipped_high,
        "clipped_tokens_low": clipped_low,
        "clipped_tokens_high": clipped_high,
        "trainable_tokens": trainable.detach(),
        "sequences": sequences.detach(),
        "ratio_sum": rv.sum() if has else zero,
        "ratio_count": torch.tensor(float(rv.numel()), dtype=f32, device=ratio_vals.device),
    }


def finalize_stats(stats):
    """Recompute fractions and means from (possibly all-reduced) sum-type entries.

    Args:
        stats: dict as returned by the losses, sums already reduced across micro-batches/ranks.
    Returns:
        a new dict with `clip_fraction*` and `ratio_mean` recomputed from the sums.
    """
    out = dict(stats)
    denom = stats["trainable_tokens"].clamp(min=1.0)
    out["clip_fraction"] = stats["clipped_tokens"] / denom
    out["clip_fraction_low"] = stats["clipped_tokens_low"] / denom
    out["clip_fraction_high"] = stats["clipped_tokens_high"] / denom
    out["ratio_mean"] = stats["ratio_sum"] / stats["ratio_count"].clamp(min=1.0)
    return out


def gspo_loss(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    *,
    eps_low=3e-4,
    eps_high=4e-4,
    num_sequences=None,
    logratio_bound=LOGRATIO_BOUND,
):
    """GSPO: one clipped term per sequence on the length-normalised sequence ratio.

    s_i = exp(mean_t(logp - old_logp)); L = -(1/N) sum_i min(s_i A_i, clip(s_i) A_i).

    Args:
        logprobs: `[B, T]` current-policy token log-probs (with grad).
        old_logprobs: `[B, T]` behaviour-policy token log-probs (no grad).
        advantages: `[B]` sequence advantages.
        loss_mask: `[B, T]` 1 for trainable tokens.
        eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high].
        num_sequences: divisor N (global count); default = local rows with a trainable token.
        logratio_bound: bound on the mean log-ratio before exp.
    Returns:
        (loss scalar, stats dict).
    """
    log_ratio, mask, on = _prep(logprobs, old_logprobs, loss_mask)
    count = mask.sum(-1)  # [B]
    valid = count > 0  # [B]
    adv = advantages.to(torch.float32).reshape(-1)  # [B]
    if adv.shape[0] != log_ratio.shape[0]:
        raise ValueError(f"advantages has {adv.shape[0]} rows for {log_ratio.shape[0]} sequences")
    seq_lr, hits = _bounded_seq_log_ratio(log_ratio, count, valid, logratio_bound)  # [B]
    ratio = torch.exp(seq_lr)  # [B]
    per_seq = torch.where(valid, _surrogate(ratio, adv, eps_low, eps_high), 0.0)  # [B]
    n = valid.sum().clamp(min=1) if num_sequences is None else num_sequences
    loss = (per_seq.sum() / n).to(torch.float32)
    low, high = _clip_masks(ratio.detach(), adv, eps_low, eps_high)  # [B]
    stats = _stats(
        low_tok=(low[:, None] & on),
        high_tok=(high[:, None] & on),
        trainable=mask.sum(),
        sequences=valid.sum().to(torch.float32),
        ratio_vals=ratio,
        ratio_valid=valid,
        hits=hits,
    )
    return loss, stats


def gspo_token_loss(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    *,
    eps_low=3e-4,
    eps_high=4e-4,
    num_sequences=None,
    logratio_bound=LOGRATIO_BOUND,
):
    """GSPO-token: per-token advantages with the sequence-level ratio.

    s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)] (value s_i, gradient through token t only);
    L = -(1/N) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it).
    Equals `gspo_loss` in value and gradient when A_it = A_i for all t.

    Args:
        logprobs, old_logprobs, loss_mask: `[B, T]`.
        advantages: `[B, T]` token advantages (a `[B]` tensor is broadcast over tokens).
        eps_low, eps_high, num_sequences, logratio_bound: as in `gspo_loss`.
    Returns:
        (loss scalar, stats dict).
    """
    log_ratio, mask, on = _prep(logprobs, old_logprobs, loss_mask)
    adv = _token_advantages(advantages, mask)  # [B, T]
    count = mask.sum(-1)  # [B]
    valid = count > 0
    seq_lr, hits = _bounded_seq_log_ratio(log_ratio, count, valid, logratio_bound)
    seq_lr = seq_lr.detach()  # [B]; the gradient flows through the token factor below
    lp = torch.where(on, logprobs.float(), 0.0)  # [B, T]
    tok_log_s = seq_lr[:, None] + lp - lp.detach()  # [B, T], value = log s_i
    ratio = torch.exp(tok_log_s)  # [B, T]
    per_tok = torch.where(on, _surrogate(ratio, adv, eps_low, eps_high), 0.0)  # [B, T]
    per_seq = per_tok.sum(-1) / count.clamp(min=1.0)  # [B]
    n = valid.sum().clamp(min=1) if num_sequences is None else num_sequences
    loss = (per_seq.sum() / n).to(torch.float32)
    low, high = _clip_masks(ratio.detach(), adv, eps_low, eps_high)  # [B, T]
    stats = _stats(
        low_tok=low & on,
        high_tok=high & on,
        trainable=mask.sum(),
        sequences=valid.sum().to(torch.float32),
        ratio_vals=torch.exp(seq_lr),
        ratio_valid=valid,
        hits=hits,
    )
    return loss, stats


def grpo_loss(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    *,
    eps_low=0.2,
    eps_high=0.28,
    aggregation="seq-mean-token-mean",
    num_sequences=None,
    num_tokens=None,
    logratio_bound=LOGRATIO_BOUND,
    norm_length=None,
):
    """GRPO baseline: per-token ratio r_it = exp(logp - old_logp), PPO clip.

    Args:
        logprobs, old_logprobs, loss_mask: `[B, T]`.
        advantages: `[B]` (broadcast over tokens) or `[B, T]`.
        eps_low, eps_high: clip range (defaults 0.2 / 0.28, clip-higher).
        aggregation: "seq-mean-token-mean" (mean over sequences of token means; divisor
            `num_sequences`), "token-mean" (DAPO; divisor `num_tokens`) or
            "seq-mean-token-sum-norm" (Dr. GRPO; token sums over `num_sequences * norm_length`).
        num_sequences, num_tokens: global divisors; default = local counts.
        logratio_bound: bound on each token log-ratio before exp.
        norm_length: the constant L_norm of "seq-mean-token-sum-norm".
    Returns:
        (loss scalar, stats dict).
    """
    log_ratio, mask, on = _prep(logprobs, old_logprobs, loss_mask)
    adv = _token_advantages(advantages, mask)  # [B, T]
    lr = log_ratio.clamp(-logratio_bound, logratio_bound)  # [B, T]
    hits = _token_bound_hits(log_ratio, on, logratio_bound)
    ratio = torch.exp(lr)  # [B, T]
    per_tok = torch.where(on, _surrogate(ratio, adv, eps_low, eps_high), 0.0)  # [B, T]
    count = mask.sum(-1)  # [B]
    valid = count > 0
    if aggregation == "seq-mean-token-mean":
        n = valid.sum().clamp(min=1) if num_sequences is None else num_sequences
        loss = ((per_tok.sum(-1) / count.clamp(min=1.0)).sum() / n).to(torch.float32)
    elif aggregation == "token-mean":
        n = mask.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        loss = (per_tok.sum() / n).to(torch.float32)
    elif aggregation == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_length > 0")
        n = valid.sum().clamp(min=1) if num_sequences is None else num_sequences
        loss = (per_tok.sum() / (n * norm_length)).to(torch.float32)
    else:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {aggregation!r}")
    low, high = _clip_masks(ratio.detach(), adv, eps_low, eps_high)
    stats = _stats(
        low_tok=low & on,
        high_tok=high & on,
        trainable=mask.sum(),
        sequences=valid.sum().to(torch.float32),
        ratio_vals=ratio,
        ratio_valid=on,
        hits=hits,
    )
    return loss, stats
