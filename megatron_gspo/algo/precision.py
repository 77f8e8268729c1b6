"""Precision tolerance: the inference engine's log-probs as pi_old for GSPO, with an audit.

GSPO's ratio s_i = exp(mean_t(logp_theta - logp_old)) (arXiv 2507.18071) is a length-normalised
sequence quantity, so small per-token
numeric differences between the rollout engine and the learner average out. The engine's
log-probs can then stand in for pi_old and the learner's "recompute old log-probs" forward pass
over the whole batch can be skipped.

Sign convention used throughout: the sequence mismatch is

    d_i = mean_t(logp_learner - logp_engine)        over trainable tokens,

so with pi_old = engine, the first mini-batch's GSPO ratio is exactly s_i = exp(d_i) (theta =
theta_old there), and the importance weight that takes engine samples to the learner's old
policy is pi_learner / pi_engine = exp(d_i) (geometric per-token mean, never exp of a sum).

This module holds the math (pure torch): audit statistics with sums that can be all-reduced,
the `auto` policy (`ToleranceController`) and the optional sequence-level corrections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "sequence_mismatch",
    "audit_sums",
    "finalize_audit",
    "mismatch_band",
    "length_bins",
    "apply_correction",
    "correction_metrics",
    "ToleranceController",
    "check_engine_logprobs",
]


def mismatch_band(eps_low: float, eps_high: float, scale: float = 1.0) -> tuple[float, float]:
    """Log-space band [log(1 - scale*eps_low), log(1 + scale*eps_high)] of the clip range."""
    lo = scale * eps_low
    return (math.log1p(-lo) if lo < 1 else -math.inf, math.log1p(scale * eps_high))


def length_bins(loss_mask, max_new_tokens: int, num_bins: int = 4):
    """Response-length bin of each sequence: quarters (num_bins) of `max_new_tokens`, by its
    trainable tokens (the bins of `async/length_*_bin<b>`).

    Args:
        loss_mask: `[B, T]`; max_new_tokens: the rollout's generation limit.
    Returns:
        `[B]` int64 bin in 0..num_bins-1.
    """
    n = (loss_mask > 0).sum(-1).to(torch.int64)  # [B]
    return (num_bins * n // max(1, int(max_new_tokens))).clamp(max=num_bins - 1)


def sequence_mismatch(learner_logprobs, engine_logprobs, loss_mask):
    """d_i = mean over trainable tokens of (logp_learner - logp_engine).

    Args:
        learner_logprobs, engine_logprobs, loss_mask: `[B, T]`.
    Returns:
        `[B]` float32; 0 for rows without trainable tokens.
    """
    mask = loss_mask.to(torch.float32)
    on = mask > 0
    diff = torch.where(on, learner_logprobs.float() - engine_logprobs.float(), 0.0)  # [B, T]
    return diff.sum(-1) / mask.sum(-1).clamp(min=1.0)


def audit_sums(learner_logprobs, engine_logprobs, loss_mask, *, eps_low, eps_high, scale=1.0,
               level="sequence", bins=None, num_bins=4):
    """Audit statistics of learner vs engine log-probs, as SUMS (all-reducible).

    Args:
        learner_logprobs, engine_logprobs, loss_mask: `[B, T]` (detached).
        eps_low, eps_high: the loss's clip range; a sequence (or token) is out of range when its
            mismatch falls outside the log band of [1 - scale*eps_low, 1 + scale*eps_high].
        scale: tolerance of the band in units of the clip range.
        level: "sequence" (GSPO: d_i against the band) or "token" (GRPO: each token's
            log-ratio against the band).
        bins, num_bins: optional `[B]` response-length bin of each sequence (`length_bins`):
            adds the per-bin sums (`[num_bins]` tensors) that `finalize_audit` logs as
            `len_bin<b>/*` (the mismatch by response length).
    Returns:
        dict of float32 0-dim tensors: tokens, sequences, abs_diff_sum, abs_diff_max,
        seq_mismatch_sum, seq_abs_mismatch_sum, seq_abs_mismatch_max, out_of_range (sequences or
        tokens, per `level`), out_of_range_den, k3_sum (K3 estimate of KL(engine || learner)
        per token, samples drawn by the engine); with `bins` also bin_sequences, bin_tokens,
        bin_abs_diff_sum, bin_seq_abs_mismatch_sum, bin_out_of_range, bin_out_of_range_den.
    """
    with torch.no_grad():
        mask = loss_mask.to(torch.float32)
        on = mask > 0
        diff = torch.where(on, learner_logprobs.float() - engine_logprobs.float(), 0.0)  # [B, T]
        count = mask.sum(-1)  # [B]
        valid = count > 0
        d = diff.sum(-1) / count.clamp(min=1.0)  # [B]
        lo, hi = mismatch_band(eps_low, eps_high, scale)
        # K3: E_engine[r - 1 - log r] with r = p_learner / p_engine; >= 0 per token.
        r = diff.clamp(-20.0, 20.0).double()  # float64: expm1(r) - r ~ r^2/2 cancels in fp32
        k3 = torch.where(on, torch.expm1(r) - r, 0.0).to(torch.float32)
        if level == "sequence":
            oor = ((d > hi) | (d < lo)) & valid
            den = valid.sum()
        elif level == "token":
            oor = ((diff > hi) | (diff < lo)) & on
            den = on.sum()
        else:
            raise ValueError(f"level: expected 'sequence' or 'token', got {level!r}")
        z = torch.zeros((), dtype=torch.float32, device=diff.device)
        f = torch.float32
        abs_d = d.abs()[valid]
        out = {
            "tokens": mask.sum(),
            "sequences": valid.sum().to(f),
            "abs_diff_sum": diff.abs().sum(),
            "abs_diff_max": diff.abs().max() if diff.numel() else z,
            "seq_mismatch_sum": d[valid].sum() if valid.any() else z,
            "seq_abs_mismatch_sum": abs_d.sum() if valid.any() else z,
            "seq_abs_mismatch_max": abs_d.max() if valid.any() else z,
            "out_of_range": oor.sum().to(f),
            "out_of_range_den": den.to(f),
            "k3_sum": k3.sum(),
        }
        if bins is not None:
            out.update(_bin_sums(bins, num_bins, valid, mask, diff, d, oor))
        return out


def _bin_sums(bins, num_bins, valid, mask, diff, d, oor) -> dict:
    """Per response-length bin sums of `audit_sums` (`[num_bins]` float32 each)."""
    f = torch.float32
    b = bins.to(torch.int64).clamp(0, num_bins - 1)  # [B]

    def per_bin(values):  # [B] -> [num_bins]
        return torch.zeros(num_bins, dtype=f, device=d.device).index_add_(0, b, values.to(f))

    v = valid.to(f)
    seq_oor = oor.to(f).sum(-1) if oor.dim() == 2 else oor.to(f)  # [B] tokens or 0/1
    den = mask.sum(-1) if oor.dim() == 2 else v  # [B]
    return {"bin_sequences": per_bin(v), "bin_tokens": per_bin(mask.sum(-1)),
            "bin_abs_diff_sum": per_bin(diff.abs().sum(-1)),
            "bin_seq_abs_mismatch_sum": per_bin(d.abs() * v),
            "bin_out_of_range": per_bin(seq_oor), "bin_out_of_range_den": per_bin(den)}


def finalize_audit(sums: dict) -> dict:
    """Turn (reduced) audit sums into the logged numbers.

    Returns:
        dict of floats: token_abs_diff_mean, token_abs_diff_max, seq_mismatch_mean,
        seq_abs_mismatch_mean, seq_abs_mismatch_max, out_of_range_fraction, k3_kl, sequences;
        with bin sums, per non-empty response-length bin b: len_bin<b>/sequences,
        len_bin<b>/seq_abs_mismatch_mean, len_bin<b>/token_abs_diff_mean,
        len_bin<b>/out_of_range_fraction.
    """
    g = {k: float(v) for k, v in sums.items() if not k.startswith("bin_")}
    out = {
        "token_abs_diff_mean": g["abs_diff_sum"] / max(g["tokens"], 1.0),
        "token_abs_diff_max": g["abs_diff_max"],
        "seq_mismatch_mean": g["seq_mismatch_sum"] / max(g["sequences"], 1.0),
        "seq_abs_mismatch_mean": g["seq_abs_mismatch_sum"] / max(g["sequences"], 1.0),
        "seq_abs_mismatch_max": g["seq_abs_mismatch_max"],
        "out_of_range_fraction": g["out_of_range"] / max(g["out_of_range_den"], 1.0),
        "k3_kl": g["k3_sum"] / max(g["tokens"], 1.0),
        "sequences": g["sequences"],
    }
    if "bin_sequences" in sums:
        bs = {k: [float(x) for x in v.reshape(-1).tolist()] for k, v in sums.items()
              if k.startswith("bin_")}
        for b, n in enumerate(bs["bin_sequences"]):
            if n <= 0:
                continue
            out[f"len_bin{b}/sequences"] = n
            out[f"len_bin{b}/seq_abs_mismatch_mean"] = bs["bin_seq_abs_mismatch_sum"][b] / n
            out[f"len_bin{b}/token_abs_diff_mean"] = (bs["bin_abs_diff_sum"][b]
                                                      / max(bs["bin_tokens"][b], 1.0))
            out[f"len_bin{b}/out_of_range_fraction"] = (bs["bin_out_of_range"][b]
                                                        / max(bs["bin_out_of_range_den"][b], 1.0))
    return out


def apply_correction(mismatch, loss_mask, advantages, *, mode, mask_bound=1e-3, tis_cap=2.0,
                     token_log_ratio=None, icepop_low=0.5, icepop_high=5.0):
    """Correction of engine/learner mismatch (formulas of icepop / mis in `corrections`).

    "mask" drops sequences with |d_i| > mask_bound (their loss mask becomes 0). "tis" weights
    each sequence by w_i = min(exp(d_i), C), the truncated importance weight from the engine's
    sampling distribution to the learner's old policy (geometric per-token mean); for the
    clipped objective, min(s A, clip(s) A) * w = min(s (A w), clip(s) (A w)) since w > 0, so the
    weight is applied to the advantages (every loss here is linear in A for a fixed sign of A).
    "mis" weights by exp(d_i) too but drops the sequences whose weight exceeds C. "icepop"
    drops the tokens whose ratio exp(log k_t) leaves [icepop_low, icepop_high].

    Args:
        mismatch: `[B]` d_i from `sequence_mismatch`.
        loss_mask: `[B, T]`.
        advantages: `[B]` or `[B, T]`.
        mode: "none", "mask", "tis", "mis" or "icepop".
        mask_bound, tis_cap: bounds of the corrections (tis_cap is C of "tis" and "mis").
        token_log_ratio: `[B, T]` log pi_learner - log pi_engine ("icepop" only).
        icepop_low, icepop_high: the IcePop band.
    Returns:
        (loss_mask, advantages, stats) — new tensors; stats (floats) has `masked_sequences`
        (rows that lost every trainable token), `masked_tokens`, `tis_weight_mean`,
        `tis_weight_min`, `tis_truncated`.
    """
    from megatron_gspo.algo import corrections

    stats = {"masked_sequences": 0.0, "masked_tokens": 0.0, "tis_weight_mean": 1.0,
             "tis_weight_min": 1.0, "tis_truncated": 0.0}
    d = mismatch.detach().to(torch.float32)
    valid = loss_mask.sum(-1) > 0
    if mode == "none":
        return loss_mask, advantages, stats
    if mode == "mask":
        drop = (d.abs() > mask_bound) & valid  # [B]
        new_mask = loss_mask * (~drop).to(loss_mask.dtype)[:, None]
        stats["masked_sequences"] = float(drop.sum())
        stats["masked_tokens"] = float((loss_mask > 0).sum() - (new_mask > 0).sum())
        return new_mask, advantages, stats
    if mode == "icepop":
        if token_log_ratio is None:
            raise ValueError("correction 'icepop' needs the token log-ratios")
        new_mask, dropped = corrections.icepop_token_mask(token_log_ratio, loss_mask,
                                                          low=icepop_low, high=icepop_high)
        stats["masked_tokens"] = float(dropped.sum())
        stats["masked_sequences"] = float((valid & ~(new_mask.sum(-1) > 0)).sum())
        return new_mask, advantages, stats
    if mode in ("tis", "mis"):
        if mode == "tis":
            raw = torch.exp(d.clamp(max=math.log(tis_cap) + 1.0))
            w = raw.clamp(max=tis_cap)  # [B]
            truncated = raw > tis_cap
            new_mask = loss_mask
        else:
            w, truncated = corrections.mis_weights(d, loss_mask, cap=tis_cap)
            new_mask = loss_mask * (~truncated).to(loss_mask.dtype)[:, None]
            stats["masked_sequences"] = float(truncated.sum())
            stats["masked_tokens"] = float((loss_mask > 0).sum() - (new_mask > 0).sum())
        adv = advantages.to(torch.float32)
        adv = adv * (w if adv.dim() == 1 else w[:, None])
        kept = valid & ~(truncated & (mode == "mis"))
        if kept.any():
            stats["tis_weight_mean"] = float(w[kept].mean())
            stats["tis_weight_min"] = float(w[kept].min())
        stats["tis_truncated"] = float((truncated & valid).sum()) if mode == "tis" else 0.0
        return new_mask, adv, stats
    raise ValueError(f"correction: expected 'none', 'mask', 'tis', 'mis' or 'icepop', got "
                     f"{mode!r}")


def correction_metrics(mode: str, stats: dict, sequences: float, tokens: float) -> dict:
    """The logged share a correction masked, named by its cause.

    Args:
        mode: the correction; stats: `apply_correction`'s; sequences / tokens: trainable ones
            before the correction.
    Returns:
        `masked_share/<mode>` (sequences for mask / mis, tokens for icepop), or for tis
        `tis_weight_mean` and `tis_truncated_share`; {} for none.
    """
    if mode == "icepop":
        return {"masked_share/icepop": stats["masked_tokens"] / max(tokens, 1.0)}
    if mode in ("mask", "mis"):
        return {f"masked_share/{mode}": stats["masked_sequences"] / max(sequences, 1.0)}
    if mode == "tis":
        return {"tis_weight_mean": stats["tis_weight_mean"],
                "tis_truncated_share": stats["tis_truncated"] / max(sequences, 1.0)}
    return {}


def check_engine_logprobs(index, engine_logprobs, loss_mask, num_response_tokens):
    """Check one sample's engine log-probs cover exactly its trained tokens.

    Args:
        index: sample id for the error message.
        engine_logprobs: list of floats or None.
        loss_mask: list of 0/1 per response token.
        num_response_tokens: response length.
    Raises:
        ValueError naming the sample when lengths disagree, a trained token has no finite
        log-prob, or a masked (environment) token carries a non-zero one.
    """
    if engine_logprobs is None:
        raise ValueError(f"sample {index}: the engine returned no log-probs; use "
                         "precision.old_logprobs=recompute")
    if len(engine_logprobs) != num_response_tokens or len(loss_mask) != num_response_tokens:
        raise ValueError(f"sample {index}: {len(engine_logprobs)} engine log-probs and "
                         f"{len(loss_mask)} mask entries for {num_response_tokens} response tokens")
    for t, (lp, m) in enumerate(zip(engine_logprobs, loss_mask, strict=True)):
        if m and not (math.isfinite(lp) and lp <= 1e-4):
            raise ValueError(f"sample {index}: engine log-prob {lp} at trained token {t} is not a "
                             "log-probability")
        if not m and lp != 0.0:
            raise ValueError(f"sample {index}: token {t} has loss mask 0 (not generated by the "
                             f"model) but an engine log-prob {lp}")


@dataclass
class ToleranceController:
    """Which pi_old to use each step: `recompute`, `rollout`, or `auto` (audited reuse).

    `auto` starts by reusing engine log-probs and audits on a schedule (the first step always).
    An audit computes the learner's log-probs anyway, so when it finds the share of out-of-range
    sequences above `tolerance` the step itself switches to those log-probs (no extra cost) and
    the controller stays in fallback, where every step recomputes (a free audit). After
    `recheck_interval` consecutive in-tolerance steps it returns to reuse. Every switch is
    recorded in `events` with the numbers behind it.

    Args:
        mode: "recompute", "rollout" or "auto".
        audit_fraction: share of steps audited while reusing (0 = never, 1 = every step).
        tolerance: max allowed out-of-range share.
        recheck_interval: in-tolerance steps in fallback before returning to reuse.
    """

    mode: str = "auto"
    audit_fraction: float = 0.25
    tolerance: float = 0.05
    recheck_interval: int = 5
    reusing: bool = True
    good_streak: int = 0
    events: list = field(default_factory=list)

    def __post_init__(self):
        if self.mode not in ("recompute", "rollout", "auto"):
            raise ValueError(f"precision.old_logprobs: expected recompute, rollout or auto, "
                             f"got {self.mode!r}")
        self.reusing = self.mode != "recompute"

    def _scheduled(self, step: int) -> bool:
        f = self.audit_fraction
        if f <= 0:
            return False
        return step == 0 or math.floor(step * f) != math.floor((step - 1) * f) or f >= 1

    def needs_learner_logprobs(self, step: int) -> bool:
        """Whether this step must run the learner's forward pass over the batch (recompute or
        audit)."""
        if self.mode == "recompute" or (self.mode == "auto" and not self.reusing):
            return True
        return self._scheduled(step)

    def decide(self, step: int, audit: dict | None) -> str:
        """Pick this step's pi_old source given its audit (None if not audited).

        Returns:
            "recompute" or "rollout".
        """
        if self.mode != "auto":
            return self.mode
        if audit is None:
            return "rollout" if self.reusing else "recompute"
        frac = audit["out_of_range_fraction"]
        over = frac > self.tolerance
        if self.reusing and over:
            self.reusing, self.good_streak = False, 0
            self.events.append({"step": step, "switch": "rollout->recompute",
                                "out_of_range_fraction": frac, "tolerance": self.tolerance})
        elif not self.reusing:
            self.good_streak = 0 if over else self.good_streak + 1
            if self.good_streak >= self.recheck_interval:
                self.reusing, self.good_streak = True, 0
                self.events.append({"step": step, "switch": "recompute->rollout",
                                    "out_of_range_fraction": frac, "tolerance": self.tolerance})
                return "rollout"
        return "rollout" if self.reusing else "recompute"

    def state_dict(self) -> dict:
        return {"reusing": self.reusing, "good_streak": self.good_streak,
                "events": list(self.events)}

    def load_state_dict(self, state: dict) -> None:
        self.reusing = bool(state["reusing"])
        self.good_streak = int(state["good_streak"])
        self.events = list(state["events"])
