"""forward_step / loss_func for Megatron-Core's `get_forward_backward_func`, calling the
`megatron_gspo.algo` losses on packed micro-batches.

Normalisation (one optimizer step = mean over ALL sequences of the global mini-batch, or all
trainable tokens for token-mean GRPO). Every sequence lies in one micro-batch (under context
parallelism its token log-probs are gathered over the CP group first), so each micro-batch's loss
is its SUM of per-sequence terms divided by the GLOBAL count N. Megatron then
  - divides the returned loss by the number of micro-batches M and multiplies it by the CP size
    (2-tuple `(loss, dict)` contract of `forward_step_calc_loss`, with
    `calculate_per_token_loss=False`), and
  - averages gradients over the DP x CP ranks (DDP `gradient_scaling_factor = 1/(dp*cp)`).
`loss_func` therefore returns `loss * M * dp`: the gradient that reaches the optimizer is
exactly d/dtheta (1/N) sum_i term_i, whatever M, the packing and the DP / CP sizes. (Each CP
rank computes the same replicated loss but back-propagates only through its own tokens, so the
DP x CP sum of the per-rank gradients is the full gradient.)

Metrics: the loss, the algo's sum-type counters and the MTP head's (`megatron.mtp_loss`, with
`LossSettings.mtp_weight` > 0) are summed over micro-batches and DP ranks
(`reduce_metrics`), ratio_min / ratio_max reduced with MIN / MAX, fractions recomputed with
`megatron_gspo.algo.losses.finalize_stats`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megatron_gspo.algo import cispo, gmpo, kl as kl_terms, losses, sapo
from megatron_gspo.algo.corrections import offpolicy_sequence_mask
from megatron_gspo.data.batch import MicroBatch, cp_local_index
from megatron_gspo.megatron import mtp_loss
from megatron_gspo.megatron.tp_logprobs import (cp_gather, vocab_parallel_entropy,
                                              vocab_parallel_logprobs)

LOSS_KINDS = ("gspo", "gspo_token", "grpo", "sapo", "cispo", "gmpo")
# Losses defined for per-token advantages (GSPO-token style, turn-level); gspo / gmpo are not.
TOKEN_ADVANTAGE_KINDS = ("gspo_token", "grpo", "sapo", "cispo")
SUM_KEYS = ("loss", "clipped_tokens", "clipped_tokens_low", "clipped_tokens_high",
            "trainable_tokens", "sequences", "ratio_sum", "ratio_count", "logratio_bound_hits",
            "entropy_sum", "kl_loss", "entropy_loss", "offpolicy_masked_sequences",
            "offpolicy_masked_tokens", "offpolicy_seen_sequences")


@dataclass(frozen=True)
class LossSettings:
    """Which policy loss and its knobs.

    kind: one of LOSS_KINDS; eps_low / eps_high: clip range (GMPO: in log space; unused by
    SAPO); grpo_aggregation: "seq-mean-token-mean" | "token-mean" | "seq-mean-token-sum-norm"
    (Dr. GRPO, over `norm_length` tokens); temperature: sampling temperature of the rollouts;
    logratio_bound: bound on log-ratios before exp; kl_coef / kl_estimator: KL-to-reference term
    in the loss (0 = off; needs `ref_logprobs` in the batch); entropy_coef: entropy bonus;
    tau_pos / tau_neg: SAPO's gate temperatures; offpolicy_mask_delta: DeepSeek-V3.2 off-policy
    sequence masking threshold (None = off); mtp_weight: weight of the MTP head's draft loss
    (`megatron.mtp_loss`; 0 = none). The KL and entropy terms are aggregated like the
    policy term (`aggregation()`).
    """

    kind: str = "gspo"
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    grpo_aggregation: str = "seq-mean-token-mean"
    temperature: float = 1.0
    logratio_bound: float = losses.LOGRATIO_BOUND
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    offpolicy_mask_delta: float | None = None
    norm_length: float | None = None
    mtp_weight: float = 0.0

    def __post_init__(self):
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"loss kind {self.kind!r} not in {LOSS_KINDS}")

    def aggregation(self) -> str:
        """How this loss (and so its KL / entropy terms) averages over the mini-batch."""
        if self.kind == "grpo":
            return self.grpo_aggregation
        return "token-mean" if self.kind == "cispo" else "seq-mean-token-mean"


@dataclass(frozen=True)
class ParallelContext:
    """What the step needs from parallel_state (explicit, so tests can build it by hand)."""

    tp_group: object = None
    cp_group: object = None
    dp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    vocab_start: int = 0
    vocab_size: int | None = None


def device_batch(mb: MicroBatch, device, ctx: ParallelContext) -> dict:
    """Move a micro-batch to `device` and cut this CP rank's positions out of it.

    Returns a dict with the model inputs (`tokens`, `position_ids`, `packed_seq_params`) and the
    loss inputs (full-row targets / masks and the CP index).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    local = cp_local_index(mb.cu_seqlens, ctx.cp_size, ctx.cp_rank).to(device)  # [S/cp]
    cu = mb.cu_seqlens.to(device=device, dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen,
                          cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
    full = {k: getattr(mb, k).to(device).reshape(-1)
            for k in ("targets", "loss_mask", "old_logprobs", "advantages")}
    return {
        "tokens": mb.tokens.to(device)[:, local],  # [1, S/cp]
        "position_ids": mb.position_ids.to(device)[:, local],
        "packed_seq_params": psp,
        "local_index": local,
        "seq_len": mb.seq_len,
        "seq_index": mb.seq_index.to(device),
        "seq_valid": mb.seq_valid.to(device),
        "seq_advantages": mb.seq_advantages.to(device),
        "token_advantages": mb.token_advantages,
        **full,
    }


def token_logprobs_full(logits: torch.Tensor, data: dict, ctx: ParallelContext,
                        temperature: float, with_entropy: bool = False):
    """[S] token log-probs (and entropy) of the whole packed row from this rank's logits.

    Args:
        logits: [1, S/cp, V/tp] model output (vocab-sharded).
    """
    tgt = data["targets"][data["local_index"]]  # [S/cp]
    out = vocab_parallel_logprobs(logits.squeeze(0), tgt, temperature=temperature,
                                  vocab_start=ctx.vocab_start, vocab_size=ctx.vocab_size,
                                  group=ctx.tp_group, return_entropy=with_entropy)
    lp, ent = out if with_entropy else (out, None)
    lp_full = cp_gather(lp, data["local_index"], data["seq_len"], ctx.cp_group)  # [S]
    if ent is not None:
        ent = cp_gather(ent, data["local_index"], data["seq_len"], ctx.cp_group)
    return lp_full, ent


def _rows(flat: torch.Tensor, data: dict) -> torch.Tensor:
    out = flat[data["seq_index"]]  # [n, L]
    return torch.where(data["seq_valid"], out, torch.zeros_like(out))


def compute_loss(lp_full: torch.Tensor, data: dict, settings: LossSettings, *,
                 num_sequences: float, num_tokens: float, entropy: torch.Tensor | None = None):
    """Policy loss + KL-to-reference + entropy bonus of one micro-batch, GLOBAL normalisation.

    Args:
        lp_full: [S] current token log-probs (with grad).
        data: `device_batch` output (+ `ref_logprobs` [S] when settings.kl_coef > 0).
        num_sequences / num_tokens: global divisors.
        entropy: [S] token entropies with grad (needed when settings.entropy_coef > 0).
    Returns:
        (loss, stats); stats gain `kl_loss` and `entropy_loss` (their parts of the loss).
    """
    loss, stats = _policy_loss(lp_full, data, settings, num_sequences=num_sequences,
                               num_tokens=num_tokens)
    agg = settings.aggregation()
    mask = _rows(data["loss_mask"], data)  # [n, L]
    zero = torch.zeros((), dtype=torch.float32, device=lp_full.device)
    kl_part, ent_part = zero, zero
    if settings.kl_coef > 0:
        if "ref_logprobs" not in data:
            raise ValueError("kl_coef > 0 but the batch has no reference log-probs")
        kl_part = kl_terms.kl_loss(_rows(lp_full, data), _rows(data["ref_logprobs"], data), mask,
                                   coef=settings.kl_coef, estimator=settings.kl_estimator,
                                   aggregation=agg, num_sequences=num_sequences,
                                   num_tokens=num_tokens, norm_length=settings.norm_length)
    if settings.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 but no differentiable entropy was given")
        ent_part = kl_terms.entropy_loss(_rows(entropy, data), mask, coef=settings.entropy_coef,
                                         aggregation=agg, num_sequences=num_sequences,
                                         num_tokens=num_tokens, norm_length=settings.norm_length)
    stats = dict(stats, kl_loss=kl_part.detach(), entropy_loss=ent_part.detach())
    return loss + kl_part + ent_part, stats


def _policy_loss(lp_full: torch.Tensor, data: dict, settings: LossSettings, *,
                 num_sequences: float, num_tokens: float):
    """Policy loss of one micro-batch, normalised by the GLOBAL counts.

    Args:
        lp_full: [S] current token log-probs (with grad).
        data: `device_batch` output.
        num_sequences / num_tokens: global divisors.
    Returns:
        (loss, stats) from `megatron_gspo.algo.losses`.
    """
    lp = _rows(lp_full, data)  # [n, L]
    old = _rows(data["old_logprobs"], data)
    mask = _rows(data["loss_mask"], data)
    k = settings.kind
    if data["token_advantages"] and k not in TOKEN_ADVANTAGE_KINDS:
        raise ValueError(f"per-token advantages need a loss kind of {TOKEN_ADVANTAGE_KINDS}, "
                         f"not {k!r}")
    adv = data["seq_advantages"] if k in ("gspo", "gmpo") else _rows(data["advantages"], data)
    zero = torch.zeros((), device=lp.device)
    off = {"offpolicy_masked_sequences": zero, "offpolicy_masked_tokens": zero,
           "offpolicy_seen_sequences": (mask.sum(-1) > 0).sum().float()}
    if settings.offpolicy_mask_delta is not None:  # DeepSeek-V3.2, with this forward's policy
        new_mask, rows, _ = offpolicy_sequence_mask(lp, old, adv, mask,
                                                    delta=settings.offpolicy_mask_delta)
        off.update(offpolicy_masked_sequences=rows.sum().float(),
                   offpolicy_masked_tokens=((mask > 0).sum() - (new_mask > 0).sum()).float())
        mask = new_mask
    bound = settings.logratio_bound
    clip = dict(eps_low=settings.eps_low, eps_high=settings.eps_high, logratio_bound=bound)
    if k == "gspo":
        out = losses.gspo_loss(lp, old, adv, mask, num_sequences=num_sequences, **clip)
    elif k == "gspo_token":
        out = losses.gspo_token_loss(lp, old, adv, mask, num_sequences=num_sequences, **clip)
    elif k == "grpo":
        out = losses.grpo_loss(lp, old, adv, mask, aggregation=settings.grpo_aggregation,
                               num_sequences=num_sequences, num_tokens=num_tokens,
                               norm_length=settings.norm_length, **clip)
    elif k == "sapo":
        out = sapo.sapo_loss(lp, old, adv, mask, tau_pos=settings.tau_pos,
                             tau_neg=settings.tau_neg, num_sequences=num_sequences,
                             logratio_bound=bound)
    elif k == "cispo":
        out = cispo.cispo_loss(lp, old, adv, mask, num_tokens=num_tokens, **clip)
    else:
        out = gmpo.gmpo_loss(lp, old, adv, mask, num_sequences=num_sequences, **clip)
    return out[0], dict(out[1], **off)


def loss_func(data: dict, settings: LossSettings, ctx: ParallelContext, num_sequences: float,
              num_tokens: float, num_microbatches: int, output: torch.Tensor, mtp_logits=None):
    """Megatron loss_func (2-tuple contract): returns (scaled loss, metrics dict); with
    `mtp_logits` (the MTP head's, inputs detached) the head's loss part is added, its metrics
    under `mtp_loss.MTP_SUM_KEYS` (`loss` stays the policy's)."""
    lp_full, ent = token_logprobs_full(output, data, ctx, settings.temperature, True)
    ent_grad = None
    if settings.entropy_coef > 0:  # vocab-parallel entropy with gradient, reduced over TP
        e = vocab_parallel_entropy(output.squeeze(0), temperature=settings.temperature,
                                   vocab_start=ctx.vocab_start, vocab_size=ctx.vocab_size,
                                   group=ctx.tp_group)  # [S/cp]
        ent_grad = cp_gather(e, data["local_index"], data["seq_len"], ctx.cp_group)  # [S]
    loss, stats = compute_loss(lp_full, data, settings, num_sequences=num_sequences,
                               num_tokens=num_tokens, entropy=ent_grad)
    metrics = {k: v.detach().float() for k, v in stats.items()}
    metrics["loss"] = loss.detach().float()
    metrics["entropy_sum"] = (ent * data["loss_mask"]).sum().detach()
    if mtp_logits is not None:
        part, sums = mtp_loss.mtp_loss(mtp_logits, data["targets"], data["loss_mask"],
                                       data["packed_seq_params"].cu_seqlens_q,
                                       weight=settings.mtp_weight, num_tokens=num_tokens,
                                       vocab_size=ctx.vocab_size or output.shape[-1])
        loss = loss + part
        metrics.update(sums)
    return loss * (num_microbatches * ctx.dp_size), metrics


def forward_step_factory(settings: LossSettings, ctx: ParallelContext, *, num_sequences: float,
                         num_tokens: float, num_microbatches: int):
    """forward_step_func(data_iterator, model) for training micro-batches (dicts from
    `device_batch`)."""

    def forward_step(data_iterator, model):
        data = next(data_iterator)
        head = None
        with (mtp_loss.decoder_capture(model) if settings.mtp_weight > 0
              else contextlib.nullcontext()) as seen:
            out = model(data["tokens"], data["position_ids"], None,
                        packed_seq_params=data["packed_seq_params"])
        if seen is not None:  # the MTP head on the detached decoder output
            head = mtp_loss.head_logits(model, seen, data["tokens"], data["position_ids"])
        return out, partial(loss_func, data, settings, ctx, num_sequences, num_tokens,
                            num_microbatches, mtp_logits=head)

    return forward_step


def logprob_forward_step_factory(ctx: ParallelContext, temperature: float,
                                 with_entropy: bool = False):
    """forward_step_func for forward-only passes that collect [S] token log-probs (and the
    entropy under `entropy` when `with_entropy`: one more pass over the vocabulary)."""

    def collect(data, output):
        with torch.no_grad():
            lp, ent = token_logprobs_full(output, data, ctx, temperature, with_entropy)
        zero = torch.zeros((), device=lp.device)
        return zero, {"logprobs": lp} | ({"entropy": ent} if with_entropy else {})

    def forward_step(data_iterator, model):
        data = next(data_iterator)
        out = model(data["tokens"], data["position_ids"], None,
                    packed_seq_params=data["packed_seq_params"])
        return out, partial(collect, data)

    return forward_step


def reduce_metrics(per_mb: list[dict], dp_group, device) -> dict[str, float]:
    """Sum micro-batch metrics, reduce over DP, recompute fractions.

    Args:
        per_mb: metric dicts from `loss_func` (empty on non-last pipeline stages).
        dp_group: data-parallel group (without CP: CP ranks hold the same replicated values).
    Returns:
        dict of floats.
    """
    keys = SUM_KEYS + (mtp_loss.MTP_SUM_KEYS if per_mb and "mtp_count" in per_mb[0] else ())
    sums = torch.zeros(len(keys), dtype=torch.float64, device=device)
    lo = torch.full((), float("inf"), dtype=torch.float64, device=device)
    hi = torch.full((), float("-inf"), dtype=torch.float64, device=device)
    for m in per_mb:
        for i, k in enumerate(keys):
            sums[i] += m[k].double()
        if m["ratio_count"] > 0:
            lo = torch.minimum(lo, m["ratio_min"].double())
            hi = torch.maximum(hi, m["ratio_max"].double())
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=dp_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=dp_group)
    mtp = {k: float(sums[i]) for i, k in enumerate(keys) if k in mtp_loss.MTP_SUM_KEYS}
    st = {k: sums[i].float() for i, k in enumerate(SUM_KEYS)}
    st = losses.finalize_stats(st)
    out = {k: float(v) for k, v in st.items()}
    out["ratio_min"] = float(lo) if torch.isfinite(lo) else 1.0
    out["ratio_max"] = float(hi) if torch.isfinite(hi) else 1.0
    # entropy_sum covers the batch's trainable tokens, off-policy-masked ones included
    ent_tokens = out["trainable_tokens"] + out["offpolicy_masked_tokens"]
    out["entropy"] = out.pop("entropy_sum") / max(ent_tokens, 1.0)
    out["offpolicy_masked_share"] = (out["offpolicy_masked_sequences"]
                                     / max(out.pop("offpolicy_seen_sequences"), 1.0))
    out["entropy/mean"] = out["entropy"]
    return out | (mtp_loss.finalize(mtp) if mtp else {})
