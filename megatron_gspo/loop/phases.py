"""The phases of one RL step, called in order by `loop/train.py`: rollout, advantages, pi_old
(with the precision audit), training over mini-batches, evaluation (the weight sync is in
`sync.py`).

Each phase takes the objects it works on plus the config, and returns metrics as a flat dict.
"""

from __future__ import annotations

import math
import random
import time

import torch

from megatron_gspo.algo.advantages import group_advantages
from megatron_gspo.algo.kl import sequence_kl
from megatron_gspo.algo.precision import (
    apply_correction,
    audit_sums,
    correction_metrics,
    check_engine_logprobs,
    finalize_audit,
    length_bins,
    sequence_mismatch,
)
from megatron_gspo.runtime import device_ledger, faults
from megatron_gspo.config import Config, ConfigError
from megatron_gspo.data.batch import pad_rows
from megatron_gspo.data.sample import Sample
from megatron_gspo.rewards.overlong import apply_overlong
from megatron_gspo.loop.weight_sync_phase import colocated_sglang, released_after_rollout
from megatron_gspo.rollout.engine import RolloutError


def _requests(prompts):
    from megatron_gspo.rollout.engine import GenerateRequest

    for item in prompts:
        yield GenerateRequest(prompt_ids=list(item.prompt_ids), prompt=item.prompt,
                              label=item.label, metadata={"row": item.row})


def rollout(cfg: Config, engine, prompts, score, tok, step: int, producer=None):
    """Generate `train.prompts_per_step` groups of `rollout.group_size` scored samples, or,
    with an asynchronous `producer`, take its oldest finished groups.

    Returns:
        (samples, metrics)
    """
    from megatron_gspo.rollout.engine import SamplingParams
    from megatron_gspo.rollout.groups import GroupSampler

    device_ledger.note("moment", "generation")
    device_ledger.note("generating")
    step_seed = cfg.train.seed * 1_000_003 + step  # per-step seed: the same after a resume
    if producer is None and hasattr(engine, "generator"):
        engine.generator.manual_seed(step_seed)
    elif producer is None and hasattr(engine, "sample_seeds") and cfg.train.deterministic:
        from megatron_gspo.rollout.engine import SampleSeeds  # SGLang: a seed per sample

        engine.sample_seeds = SampleSeeds(step_seed)
    if producer is not None:  # asynchronous rollouts: the oldest finished groups
        samples, m = producer.take(step)
    elif cfg.agent.enabled:
        from megatron_gspo.agent.loop import rollout_episodes

        samples, m = rollout_episodes(cfg, engine, _requests(prompts), tok, step)
    else:
        sampler = GroupSampler(engine, cfg.rollout.group_size, score,
                               sampling=SamplingParams.for_rollouts(cfg.rollout, tok),
                               oversample_factor=cfg.rollout.over_sample,
                               drop_zero_variance=cfg.rollout.drop_zero_variance_groups)
        try:
            samples, gm = sampler.collect(_requests(prompts), cfg.train.prompts_per_step)
        except RolloutError as e:  # e.g. every sampled group had a failed sample
            raise RolloutError(f"step {step}: {e}") from None
        m = {f"rollout/{k}": v for k, v in gm.items()}
    for k, v in getattr(engine, "metrics", {}).items():  # SGLang client counters, since start
        m[f"rollout/engine_{k}_total"] = float(v)
    if hasattr(engine, "speculative_metrics"):  # the embedded engine's drafting (adaptive)
        m.update(engine.speculative_metrics())
    from megatron_gspo.rewards.verifier import verifier_counts

    m.update(verifier_counts())  # this step's math-verify comparisons, timeouts, crashes
    if not samples:
        raise RolloutError(f"step {step}: no group to train: {_why_no_group(m)}")
    if colocated_sglang(cfg):  # hand the GPUs to the learner until the next weight sync
        engine.release_memory(released_after_rollout(cfg))
    rewards = torch.tensor([float(s.reward) for s in samples])
    lengths = torch.tensor([float(len(s.response_ids)) for s in samples])
    m.update({
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(samples) > 1 else 0.0,
        "reward/max": rewards.max().item(),
        "reward/min": rewards.min().item(),
        "tokens/generated": float(sum(s.num_trainable for s in samples)),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples)
        / len(samples),
        "rollout/samples": float(len(samples)),
        "rollout/weight_version": float(min(s.weight_version for s in samples)),
    })
    return samples, m


def _why_no_group(m: dict) -> str:
    """What happened to a round's groups, from the rollout metrics."""
    zero = int(m.get("rollout/groups_zero_variance", m.get("agent/dropped_groups", 0)))
    total = int(m.get("rollout/groups_generated", zero))
    if zero:
        return (f"{zero} of {total} sampled groups had equal rewards (dropped by "
                "rollout.drop_zero_variance_groups); every reward the same is usually a reward "
                "function or label problem")
    return f"{total} groups sampled, none complete (prompts exhausted?)"


def broadcast(samples):
    """Rank 0's samples on every rank."""
    from megatron_gspo.megatron.learner import broadcast_samples

    return broadcast_samples(samples)


def wait_for_rank0() -> None:
    """Every rank waits for rank 0 (after its server start-up, evaluation and weight push) on
    the gloo group with `parallel.rank0_wait_timeout`, not in an NCCL collective."""
    from megatron_gspo.megatron.parallel import wait_for_rank0 as wait

    wait()


def fill_advantages(cfg: Config, samples: list[Sample]) -> dict:
    """Group-normalised advantages; per-token for GSPO-token (turn-level in agent mode), after
    DAPO's overlong options (`rewards.overlong`). Returns their `reward/overlong_*` metrics."""
    a, rw = cfg.algorithm, cfg.reward
    if cfg.agent.enabled and cfg.agent.advantage == "turn":
        from megatron_gspo.agent.loop import fill_turn_advantages

        fill_turn_advantages(cfg, samples)
        return {}
    m = {}
    if rw.overlong_filter or rw.overlong_buffer:
        m = apply_overlong(samples, max_length=cfg.rollout.max_new_tokens,
                           buffer=rw.overlong_buffer, factor=rw.overlong_penalty,
                           filter_truncated=rw.overlong_filter)
    adv = group_advantages(torch.tensor([float(s.reward) for s in samples]),
                           cfg.rollout.group_size, scale=a.advantage_scale, eps=a.advantage_eps)
    for s, v in zip(samples, adv.tolist(), strict=True):
        s.advantage = [v] * len(s.response_ids) if a.loss == "gspo_token" else v
    return m


def _split_audit(cfg: Config, samples: list[Sample], step: int) -> bool:
    """Asynchronous batch with stale samples: pi_old comes from `async_audit`."""
    return cfg.rollout.mode == "async" and any(s.weight_version < step for s in samples)


def learner_logprobs_needed(cfg: Config, controller, samples: list[Sample], step: int) -> bool:
    """Whether `old_logprobs` needs the learner's log-probs of the batch this step (recompute,
    scheduled audit, or no engine log-probs), so the reference phase can compute them in the
    same pass. False for a split asynchronous audit (it runs its own passes)."""
    if _split_audit(cfg, samples, step):
        return False
    has_engine = all(s.rollout_logprobs is not None for s in samples)
    return controller.needs_learner_logprobs(step) or not has_engine


def reference_logprobs(cfg: Config, learner, samples: list[Sample], with_policy: bool = False):
    """Reference log-probs, the KL metrics and, with `algorithm.kl_in: reward`, the KL penalty
    subtracted from every sample's reward (so this phase runs before the advantages).

    One pass over the batch: the frozen reference's forward alone, or, when the learner's own
    log-probs are needed too (`with_policy`, or the engine returned none), the policy and the
    reference in one pipeline schedule (`Learner.forward_logprobs_with_reference`).

    kl/mean and kl/max are the sequence KL (chosen estimator) of the sampling policy's
    log-probs (the engine's, or the learner's when the engine returned none) to the reference.

    Returns:
        (reference log-prob lists or None when KL is off; the learner's log-prob lists when the
        pass computed them, else None; metrics dict).
    """
    a = cfg.algorithm
    if a.kl_coef == 0:
        return None, None, {}
    t0 = time.perf_counter()
    has_engine = all(s.rollout_logprobs is not None for s in samples)
    policy = None
    if with_policy or not has_engine:
        policy, ref = learner.forward_logprobs_with_reference(samples)
    else:
        ref = learner.forward_logprobs(samples, reference=True)
    sampled = [list(s.rollout_logprobs) for s in samples] if has_engine else policy
    mask = pad_rows([list(map(float, s.loss_mask)) for s in samples])  # [B, T]
    seq, count = sequence_kl(pad_rows(sampled), pad_rows(ref), mask, a.kl_estimator)  # [B]
    has = count > 0
    m = {"kl/mean": float(seq[has].mean()) if has.any() else 0.0,
         "kl/max": float(seq[has].max()) if has.any() else 0.0}
    if a.kl_in == "reward":
        for s, k in zip(samples, seq.tolist(), strict=True):
            s.reward = float(s.reward) - a.kl_coef * k
        m["kl/reward_penalty_mean"] = a.kl_coef * m["kl/mean"]
    m["time/reference_logprobs"] = time.perf_counter() - t0
    return ref, policy, m


def old_logprobs(cfg: Config, learner, controller, samples: list[Sample], step: int,
                 learner_lps=None):
    """Decide pi_old for this step and audit the engine's log-probs when scheduled.

    Args:
        learner_lps: the learner's log-probs of the batch when an earlier pass of this step
            computed them (`reference_logprobs`); None = run the forward here when needed.
    Returns:
        (old, source, metrics): `old` is None when the engine's `rollout_logprobs` are used,
        else the learner's per-sample log-prob lists; source is "rollout" or "recompute".
    """
    if _split_audit(cfg, samples, step):  # stale samples: split audit
        from megatron_gspo.loop.stale_audit import split_old_logprobs

        return split_old_logprobs(cfg, learner, controller, samples, step, pad_rows, _correct)
    p, a = cfg.precision, cfg.algorithm
    m: dict = {}
    has_engine = all(s.rollout_logprobs is not None for s in samples)
    if not has_engine and p.old_logprobs == "rollout":
        raise ConfigError("precision.old_logprobs: 'rollout' but the engine returned no "
                          "log-probs; use 'recompute' or 'auto'")
    need = controller.needs_learner_logprobs(step) or not has_engine
    if not need:
        learner_lps = None
    elif learner_lps is None:
        learner_lps = learner.forward_logprobs(samples)
    audit = None
    if has_engine and (learner_lps is not None or p.old_logprobs != "recompute"):
        for s in samples:
            check_engine_logprobs(s.index, s.rollout_logprobs, s.loss_mask, len(s.response_ids))
    if learner_lps is not None and has_engine:
        lo, hi, level = a.audit_range()
        mask = pad_rows([list(map(float, s.loss_mask)) for s in samples])
        learner_t = pad_rows(learner_lps)
        engine_t = pad_rows([s.rollout_logprobs for s in samples])
        sums = audit_sums(learner_t, engine_t, mask, eps_low=lo, eps_high=hi,
                          scale=p.mismatch_scale, level=level,
                          bins=length_bins(mask, cfg.rollout.max_new_tokens))
        audit = finalize_audit(sums)
        m.update({f"precision/{k}": v for k, v in audit.items()})
        if p.correction != "none":
            m.update(_correct(samples, learner_t, engine_t, mask, p))
    source = controller.decide(step, audit) if has_engine else "recompute"
    m["precision/audited"] = float(audit is not None)
    return (learner_lps if source == "recompute" else None), source, m


def _correct(samples, learner_t, engine_t, mask, p) -> dict:
    """Apply `precision.correction` to the samples' loss masks and advantages; returns
    `precision/masked_sequences` and the share by cause (`algo.precision.correction_metrics`)."""
    tok_adv = isinstance(samples[0].advantage, list)
    adv = pad_rows([s.advantage for s in samples]) if tok_adv else \
        torch.tensor([float(s.advantage) for s in samples])
    d = sequence_mismatch(learner_t, engine_t, mask)
    new_mask, new_adv, st = apply_correction(
        d, mask, adv, mode=p.correction, mask_bound=p.mask_bound, tis_cap=p.tis_cap,
        token_log_ratio=torch.where(mask > 0, learner_t - engine_t, 0.0),
        icepop_low=p.icepop_low, icepop_high=p.icepop_high)
    for i, s in enumerate(samples):
        r = len(s.response_ids)
        s.loss_mask = [int(v) for v in new_mask[i, :r].tolist()]
        s.advantage = new_adv[i, :r].tolist() if tok_adv else float(new_adv[i])
    m = correction_metrics(p.correction, st, float((mask.sum(-1) > 0).sum()), float(mask.sum()))
    m["masked_sequences"] = float(sum(s.num_trainable == 0 for s in samples))
    return {f"precision/{k}": v for k, v in m.items()}


def train_on_batch(cfg: Config, learner, samples: list[Sample], old, step: int,
                   ref=None) -> dict:
    """`algorithm.mini_batches` optimizer steps, each on a disjoint share of the batch (`ref`:
    per-sample reference log-probs for the KL term in the loss).

    Returns:
        metrics averaged over the mini-batches (tokens and `update_skipped`, the updates skipped
        for a non-finite loss or gradient, summed; lr of the last step).
    """
    parts = minibatch_parts(len(samples), cfg.algorithm.mini_batches, cfg.train.seed, step)
    per = []
    for idx in parts:
        if not idx:
            continue
        mb = [samples[i] for i in idx]
        if faults.active("nan_loss", step):  # crash tests: a step with a non-finite loss
            for s in mb:
                s.advantage = [math.nan] * len(s.response_ids) if isinstance(
                    s.advantage, list) else math.nan
        per.append(learner.train_step(mb, None if old is None else [old[i] for i in idx],
                                      None if ref is None else [ref[i] for i in idx]))
    out: dict = {}
    for key in per[0]:
        vals = [p[key] for p in per if key in p]
        if key in ("tokens", "trainable_tokens", "sequences", "micro_batches", "packed_tokens",
                   "time_fwd_bwd", "time_optimizer", "update_skipped",
                   "offpolicy_masked_sequences", "offpolicy_masked_tokens"):
            out[key] = float(sum(vals))
        elif key == "lr":
            out[key] = float(vals[-1])
        else:
            finite = [v for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
            out[key] = float(sum(finite) / len(finite)) if finite else float("nan")
    out["train/first_minibatch_ratio_mean"] = float(per[0].get("ratio_mean", float("nan")))
    out.update(clip_split(per))
    out["optimizer_steps"] = float(len(per))
    return out


def minibatch_parts(n: int, k: int, seed: int, step: int) -> list[list[int]]:
    """Sample indices of each of the `k` mini-batches of a step (seeded shuffle, then k
    near-equal consecutive shares; a share may be empty when n < k)."""
    order = list(range(n))
    random.Random(seed * 7919 + step).shuffle(order)
    return [order[i * n // k:(i + 1) * n // k] for i in range(k)]


def clip_split(per: list[dict]) -> dict:
    """Clip fraction split by cause, token-weighted (share of trainable tokens whose term is
    clipped). On a step's first mini-batch the learner's weights still equal pi_old's, so what
    clips there is engine/learner mismatch (zero when pi_old is recomputed); later mini-batches
    add the policy's drift over the step's earlier updates.

    Args:
        per: the learner's metrics of each mini-batch, in training order.
    Returns:
        `clip_fraction/first_minibatch`, `clip_fraction/later_minibatches` (absent with one
        mini-batch), `clip_fraction/minibatch_<i>` for each, and `ratio/spread` (largest minus
        smallest ratio over the step's mini-batches).
    """
    out: dict = {}

    def frac(rows: list[dict]) -> float:
        tok = sum(float(r.get("trainable_tokens", 0.0)) for r in rows)
        clipped = sum(float(r.get("clipped_tokens", 0.0)) for r in rows)
        return clipped / tok if tok > 0 else 0.0

    if not per or "clipped_tokens" not in per[0]:
        return out
    for i, r in enumerate(per):
        out[f"clip_fraction/minibatch_{i}"] = frac([r])
    out["clip_fraction/first_minibatch"] = frac(per[:1])
    if len(per) > 1:
        out["clip_fraction/later_minibatches"] = frac(per[1:])
    lo = [r["ratio_min"] for r in per if "ratio_min" in r]
    hi = [r["ratio_max"] for r in per if "ratio_max" in r]
    if lo and hi:
        out["ratio/spread"] = float(max(hi) - min(lo))
    return out


def evaluate(cfg: Config, engine, tok, score, prompts) -> dict:
    """Every eval set: `train.eval_samples` responses per prompt at `train.eval_temperature`
    (0: greedy; top-p/top-k of the rollouts; episodes in agent mode), reward_mean, mean@n and
    pass@k per set (see `loop/evaluation.py`). `prompts`: {set name: items} or one list."""
    from megatron_gspo.loop.evaluation import evaluate as evaluate_sets

    return evaluate_sets(cfg, engine, tok, score, prompts)


def sample_preview(samples: list[Sample], tok, n: int, step: int) -> str:
    """A few decoded responses with their rewards, for the log."""
    lines = [f"step {step} samples:"]
    for s in samples[:n]:
        text = tok.decode(s.response_ids, skip_special_tokens=False).replace("\n", "\\n")
        lines.append(f"  reward={s.reward:+.3f} adv={_adv(s):+.3f} | {text[:160]}")
    return "\n".join(lines)


def _adv(s: Sample) -> float:
    a = s.advantage
    return float(a[0]) if isinstance(a, list) and a else float(a or 0.0)


def moe_routing_start(learner, samples: list[Sample]) -> dict:
    """MoE: every sample gets the learner's routing at the step's start weights (r2 replays it;
    the expert-change rate compares with it): a recording forward unless the pi_old forward
    already took it. Collective; {} for dense models."""
    rt = getattr(learner, "routing", None)
    if rt is None or rt.has_record(samples, learner.steps):
        return {}
    learner.forward_logprobs(samples)
    return {"moe/recording_forward": 1.0}


def moe_routing_end(cfg: Config, learner, samples: list[Sample], step: int) -> dict:
    """MoE: this step's `moe/*` routing metrics (collective). With one mini-batch no training
    forward ran after an update, so a forward measures the expert-change rate."""
    rt = getattr(learner, "routing", None)
    if rt is None:
        return {}
    parts = [p for p in minibatch_parts(len(samples), cfg.algorithm.mini_batches,
                                        cfg.train.seed, step) if p]
    if len(parts) < 2:
        learner.forward_logprobs([samples[i] for i in parts[0]])
    rt.count_no_record(samples)
    return rt.pop_metrics(learner.device)
