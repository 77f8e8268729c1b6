"""Every key a training run can write to `RUN_DIR/metrics.jsonl` (and tensorboard / W&B): its
unit and its meaning, declared once. `cli/reference.py` renders it as the site's metrics
reference (reference/metrics.md); tests/loop/test_metric_keys.py runs tiny CPU runs and fails
on a logged key this table lacks, and on an entry whose words no code writes.

A key pattern is literal text with placeholders: `<name>` stands for one path segment (no `/`),
`<name...>` for one or more segments, and `[...]` for an optional part (`eval/[<set>/]mean@<n>`
is `eval/mean@4` and `eval/gsm8k/mean@4`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MetricGroup", "GROUPS", "entries", "pattern_regex", "find_entry"]


@dataclass(frozen=True)
class MetricGroup:
    """A family of keys: a title, when they are logged, and (key pattern, unit, meaning) rows."""

    title: str
    when: str
    rows: tuple[tuple[str, str, str], ...]


_AUDIT = "`precision/stale/*`: the same number over the stale samples of an asynchronous batch " \
         "(engine precision plus the policy's change since they were generated)"

GROUPS: tuple[MetricGroup, ...] = (
    MetricGroup("Row", "every row", (
        ("step", "step", "0-based training step of the row (a resumed run rewrites the steps "
                         "after its checkpoint)"),
        ("time", "unix seconds", "wall-clock time the row was written"),
    )),
    MetricGroup("Reward and responses", "every step (phase 1-2, rollout)", (
        ("reward/mean", "reward", "mean reward of the step's trained samples as "
                                  "the reward function scored them (before KL-in-reward "
                                  "and overlong shaping)"),
        ("reward/std", "reward", "standard deviation of those rewards"),
        ("reward/max", "reward", "largest reward of the step"),
        ("reward/min", "reward", "smallest reward of the step"),
        ("reward/overlong_penalty_mean", "reward", "mean DAPO overlong penalty added to the "
                                                   "rewards (`reward.overlong_buffer` > 0)"),
        ("reward/overlong_punished_share", "share", "share of samples that got an overlong "
                                                    "penalty (`reward.overlong_buffer` > 0)"),
        ("reward/overlong_filtered_share", "share", "share of samples truncated at "
                                                    "`rollout.max_new_tokens` whose loss mask "
                                                    "was cleared (`reward.overlong_filter`)"),
        ("response_length/mean", "tokens", "mean response length (model and environment "
                                           "tokens of the response)"),
        ("response_length/max", "tokens", "longest response of the step"),
        ("tokens/generated", "tokens", "trainable (model-generated, loss mask 1) tokens of the "
                                       "step's samples"),
        ("rewards/verifier_calls", "count", "math-verify comparisons this step (`reward.name: "
                                            "math`; absent until the verifier is first used)"),
        ("rewards/verifier_timeouts", "count", "of those, comparisons that ran past their time "
                                               "limit (scored 0)"),
        ("rewards/verifier_crashes", "count", "of those, comparisons whose worker process died "
                                              "(scored 0, worker restarted)"),
    )),
    MetricGroup("Rollout", "every step; `rollout/groups_*`, `rollout/rounds`, "
                "`rollout/samples_*` and `rollout/zero_variance_share` with the group sampler "
                "(synchronous, non-agent rollouts)", (
        ("rollout/samples", "count", "samples trained this step (groups x `rollout.group_size`)"),
        ("rollout/weight_version", "version", "oldest weight version that generated a trained "
                                              "sample (step t's weights are version t)"),
        ("rollout/truncated_fraction", "share", "share of samples that stopped at "
                                                "`rollout.max_new_tokens` (finish reason length)"),
        ("rollout/rounds", "count", "generation rounds the sampler needed to fill the batch"),
        ("rollout/samples_generated", "count", "samples generated, kept or not"),
        ("rollout/samples_failed", "count", "samples whose request failed (their group is not "
                                            "trained)"),
        ("rollout/groups_generated", "count", "groups generated"),
        ("rollout/groups_kept", "count", "groups trained this step"),
        ("rollout/groups_short", "count", "groups missing from `train.prompts_per_step` after "
                                          "the last round (0 unless prompts ran out)"),
        ("rollout/groups_surplus", "count", "complete groups generated beyond the batch "
                                            "(`rollout.over_sample`), not trained"),
        ("rollout/groups_failed", "count", "groups left out because a sample failed"),
        ("rollout/groups_zero_variance", "count", "groups whose rewards were all equal (dropped "
                                                  "with `rollout.drop_zero_variance_groups`)"),
        ("rollout/zero_variance_share", "share", "groups_zero_variance / groups_generated: "
                                                 "near 1 means the task is too easy or too hard, "
                                                 "or the reward is broken"),
        ("rollout/engine_requests_total", "count", "SGLang engine: generate requests since the "
                                                   "start of the process"),
        ("rollout/engine_retries_total", "count", "SGLang engine: request retries (after an "
                                                  "error or an aborted answer), since start"),
        ("rollout/engine_aborted_total", "count", "SGLang engine: answers with finish reason "
                                                  "abort (retried), since start"),
        ("rollout/engine_failed_total", "count", "SGLang engine: requests that failed after "
                                                 "their retries (the sample is marked failed), "
                                                 "since start"),
        ("rollout/engine_capped_total", "count", "SGLang engine: requests whose max_new_tokens "
                                                 "was cut to fit the servers' context length, "
                                                 "since start"),
    )),
    MetricGroup("Optimisation (learner)", "every step (phase 5); per mini-batch, then averaged "
                "over the step's `algorithm.mini_batches` unless the meaning says summed", (
        ("loss", "loss", "policy loss (plus the KL and entropy terms when on)"),
        ("grad_norm", "L2 norm", "gradient norm before clipping (`optimizer.clip_grad`); NaN "
                                 "on a skipped update"),
        ("lr", "learning rate", "learning rate of the step's last update"),
        ("update_skipped", "count", "summed: optimizer updates skipped for a non-finite loss or "
                                    "gradient (`train.max_skipped_steps` ends the run)"),
        ("optimizer_steps", "count", "optimizer updates this step (non-empty mini-batches)"),
        ("clip_fraction", "share", "share of trainable tokens whose loss term was clipped (a "
                                   "clipped GSPO sequence clips all its tokens); GSPO ~0.15, "
                                   "GRPO ~1e-3"),
        ("clip_fraction_low", "share", "clipped below 1 - eps_low (negative advantage)"),
        ("clip_fraction_high", "share", "clipped above 1 + eps_high (positive advantage)"),
        ("clip_fraction/first_minibatch", "share", "clip fraction of the first mini-batch, where "
                                                   "the learner still has pi_old's weights: "
                                                   "engine/learner mismatch alone (0 with "
                                                   "recompute)"),
        ("clip_fraction/later_minibatches", "share", "clip fraction of the later mini-batches "
                                                     "(mismatch plus policy drift; absent with "
                                                     "one mini-batch)"),
        ("clip_fraction/minibatch_<i>", "share", "clip fraction of mini-batch i of the step"),
        ("clipped_tokens", "tokens", "tokens whose term was clipped"),
        ("clipped_tokens_low", "tokens", "of those, clipped at the low bound"),
        ("clipped_tokens_high", "tokens", "of those, clipped at the high bound"),
        ("ratio_mean", "ratio", "mean importance ratio (GSPO: sequence ratio s_i per sequence; "
                                "GRPO: per token)"),
        ("ratio_min", "ratio", "smallest ratio of the mini-batch"),
        ("ratio_max", "ratio", "largest ratio of the mini-batch"),
        ("ratio_sum", "ratio", "sum of the ratios behind ratio_mean"),
        ("ratio_count", "count", "number of ratios behind ratio_mean (sequences or tokens)"),
        ("ratio/spread", "ratio", "largest ratio_max minus smallest ratio_min over the step's "
                                  "mini-batches"),
        ("train/first_minibatch_ratio_mean", "ratio", "ratio_mean of the first mini-batch (1 "
                                                      "when pi_old is the learner's own)"),
        ("logratio_bound_hits", "count", "mean log-ratios clamped to [-20, 20] before exp (should "
                                         "stay 0)"),
        ("entropy", "nats", "mean token entropy of the policy over the trainable tokens"),
        ("entropy/mean", "nats", "the same number as entropy, under the name other trainers use"),
        ("entropy_loss", "loss", "the entropy bonus's part of the loss (0 when "
                                 "`algorithm.entropy_coef` is 0)"),
        ("kl_loss", "loss", "the KL-to-reference part of the loss (0 unless `algorithm.kl_coef` "
                            "> 0 with `kl_in: loss`)"),
        ("offpolicy_masked_sequences", "count", "summed: sequences dropped by the off-policy "
                                                "sequence mask "
                                                "(`precision.offpolicy_mask_delta`)"),
        ("offpolicy_masked_tokens", "tokens", "summed: their trainable tokens"),
        ("offpolicy_masked_share", "share", "masked sequences / sequences seen"),
        ("sequences", "count", "summed: sequences trained this step"),
        ("trainable_tokens", "tokens", "summed: tokens with loss mask 1 trained this step"),
        ("tokens", "tokens", "summed: prompt + response tokens trained this step"),
        ("packed_tokens", "tokens", "summed: tokens of the packed micro-batches on this rank "
                                    "(padding included)"),
        ("micro_batches", "count", "summed: micro-batches (`algorithm.micro_batch_tokens`)"),
        ("tokens_per_s", "tokens/s", "training throughput of a mini-batch (tokens / its "
                                     "forward-backward and optimizer time)"),
        ("time_fwd_bwd", "seconds", "summed: forward and backward time of the step's updates"),
        ("time_optimizer", "seconds", "summed: optimizer time of the step's updates"),
    )),
    MetricGroup("pi_old and the precision audit", "`precision/old_logprobs` and "
                "`precision/audited` every step; the audit numbers on audited steps "
                "(`precision.audit_fraction`, every step with recompute); " + _AUDIT, (
        ("precision/old_logprobs", "text", "where pi_old came from this step: `rollout` (the "
                                           "engine's log-probs) or `recompute` (the learner's)"),
        ("precision/audited", "0/1", "1 when this step compared learner and engine log-probs"),
        ("precision/[stale/]token_abs_diff_mean", "nats", "mean |logp_learner - logp_engine| "
                                                          "per trainable token"),
        ("precision/[stale/]token_abs_diff_max", "nats", "largest per-token |difference|"),
        ("precision/[stale/]seq_mismatch_mean", "nats", "mean of d_i = mean_t(logp_learner - "
                                                        "logp_engine) over sequences"),
        ("precision/[stale/]seq_abs_mismatch_mean", "nats", "mean |d_i|"),
        ("precision/[stale/]seq_abs_mismatch_max", "nats", "largest |d_i|"),
        ("precision/[stale/]out_of_range_fraction", "share", "share of sequences whose |d_i| is "
                                                             "beyond the clip range (times "
                                                             "`precision.mismatch_scale`): what "
                                                             "decides `auto` against "
                                                             "`precision.tolerance`"),
        ("precision/[stale/]k3_kl", "nats", "K3 KL estimate between the engine's and the "
                                            "learner's token distributions"),
        ("precision/[stale/]sequences", "count", "sequences audited"),
        ("precision/[stale/]len_bin<b>/sequences", "count", "audited sequences in response-"
                                                            "length bin b (quarters of "
                                                            "`rollout.max_new_tokens` by "
                                                            "trainable tokens; empty bins "
                                                            "not logged)"),
        ("precision/[stale/]len_bin<b>/seq_abs_mismatch_mean", "nats", "mean |d_i| of the "
                                                                       "sequences in bin b"),
        ("precision/[stale/]len_bin<b>/token_abs_diff_mean", "nats", "mean per-token |logp_"
                                                                     "learner - logp_engine| "
                                                                     "in bin b"),
        ("precision/[stale/]len_bin<b>/out_of_range_fraction", "share", "out-of-range share "
                                                                        "(as above) in bin b"),
        ("precision/masked_sequences", "count", "sequences left with no trainable token after "
                                                "`precision.correction`"),
        ("precision/masked_share/<mode>", "share", "share dropped by the correction `mode`: "
                                                   "sequences for mask and mis, tokens for "
                                                   "icepop"),
        ("precision/tis_weight_mean", "weight", "mean truncated importance weight min(exp(d_i), "
                                                "C) (`precision.correction: tis`)"),
        ("precision/tis_truncated_share", "share", "share of sequences whose weight hit "
                                                   "`precision.tis_cap`"),
        ("precision/current_samples", "count", "async: samples generated by this step's "
                                               "weights"),
        ("precision/stale_samples", "count", "async: samples generated by older weights"),
        ("precision/stale_audited", "0/1", "async: 1 when the stale samples were audited"),
    )),
    MetricGroup("KL to the reference", "`algorithm.kl_coef` > 0", (
        ("kl/mean", "nats", "mean sequence KL (`algorithm.kl_estimator`) of the sampling policy "
                            "to the frozen reference"),
        ("kl/max", "nats", "largest sequence KL of the step"),
        ("kl/reward_penalty_mean", "reward", "mean KL penalty subtracted from the rewards "
                                             "(`algorithm.kl_in: reward`)"),
    )),
    MetricGroup("MTP draft head", "`algorithm.mtp_loss_weight` > 0 (phase 5; per mini-batch, "
                "then averaged)", (
        ("mtp/loss", "nats", "cross-entropy of the multi-token-prediction head (layer k "
                             "predicting token i + k + 1) on the response tokens, mean over "
                             "those positions and the MTP layers"),
        ("mtp/accuracy", "share", "argmax agreement of the MTP head with the sampled next tokens "
                                  "on those positions (a greedy one-token draft's "
                                  "acceptance when the rollouts are greedy)"),
        ("mtp/tokens", "tokens", "positions the MTP loss covered (summed over the MTP layers and "
                                 "data-parallel ranks)"),
    )),
    MetricGroup("MoE routing", "MoE models, every step (`moe.*`)", (
        ("moe/routing_agreement/layer_<i>", "share", "share of tokens whose top-k experts agree "
                                                     "between learner and engine, MoE layer i"),
        ("moe/routing_agreement/mean", "share", "mean over the MoE layers"),
        ("moe/routing_agreement/min", "share", "lowest layer"),
        ("moe/expert_change_rate", "share", "share of routed (token, expert) choices that "
                                            "changed across one optimizer step (paper: ~10% "
                                            "for Qwen3-30B-A3B)"),
        ("moe/expert_change_rate/layer_<i>", "share", "the same for MoE layer i"),
        ("moe/routers_replayed_share", "share", "share of routers that replayed recorded "
                                                "routing (`moe.routing_replay` r2 / r3; 1 or "
                                                "the run stops)"),
        ("moe/tokens_without_routing_record", "tokens", "tokens that had no recorded routing "
                                                        "to replay"),
        ("moe/recording_forward", "0/1", "1 when an extra forward recorded the routing at the "
                                         "step's start weights"),
    )),
    MetricGroup("Asynchronous rollouts", "`rollout.mode: async`", (
        ("async/staleness_<d>", "count", "trained samples generated d steps ago (d = 0 .. "
                                         "`rollout.max_staleness`)"),
        ("async/staleness_max", "steps", "largest staleness trained this step"),
        ("async/staleness_over_bound", "count", "trained samples beyond `rollout.max_staleness` "
                                                "(0 unless the bound is broken)"),
        ("async/partial_samples", "count", "trained samples whose tokens span several weight "
                                           "versions"),
        ("async/<which>_samples", "count", "samples trained (which = trained) or generated "
                                           "(which = generated) this step"),
        ("async/length_<which>_mean", "tokens", "mean response length of the trained or "
                                                "generated samples"),
        ("async/length_<which>_bin<b>", "count", "samples per response-length bin b (quarters "
                                                 "of `rollout.max_new_tokens`)"),
        ("async/turns_<which>_mean", "turns", "mean model turns of the trained or generated "
                                              "samples"),
        ("async/wait_time", "seconds", "time the trainer waited for finished groups"),
        ("async/groups_waiting", "count", "finished groups queued for training after the take"),
        ("async/groups_in_flight", "count", "groups being generated"),
        ("async/admitted_version_min", "version", "oldest weight version of the groups taken"),
        ("async/requests_total", "count", "generate requests since start"),
        ("async/samples_restarted_total", "count", "samples regenerated from scratch after a "
                                                   "weight update, since start"),
        ("async/samples_continued_total", "count", "samples continued under new weights after a "
                                                   "weight update, since start"),
        ("async/groups_failed_total", "count", "groups dropped for a failed sample, since start"),
        ("async/groups_zero_variance_total", "count", "groups dropped for equal rewards, since "
                                                      "start"),
    )),
    MetricGroup("Agent episodes", "`agent.enabled`; means over the step's episodes", (
        ("agent/reward", "reward", "mean episode reward (sum of turn rewards)"),
        ("agent/num_turns", "turns", "mean model turns per episode"),
        ("agent/model_tokens", "tokens", "mean model (trained) tokens per episode"),
        ("agent/env_tokens", "tokens", "mean environment and tool tokens per episode (loss mask "
                                       "0)"),
        ("agent/episode_time_s", "seconds", "mean episode wall time"),
        ("agent/tool_calls", "count", "mean tool calls per episode"),
        ("agent/tool_outputs_truncated", "count", "mean tool outputs cut to their limit per "
                                                  "episode"),
        ("agent/tool_errors/<kind>", "count", "mean tool errors per episode by kind: "
                                              "invalid_call, unknown_tool, bad_arguments, "
                                              "tool_error, timeout, too_many_calls"),
        ("agent/env_errors", "share", "share of episodes ended by an environment, tool parser "
                                      "or chat template error (reward 0; first of each kind in "
                                      "events.log)"),
        ("agent/answered", "share", "share of episodes that ended with an answer (no tool call)"),
        ("agent/stop/<reason>", "share", "share of episodes by stop reason: done, max_turns, "
                                         "max_total_tokens, turn_length, turn_timeout, "
                                         "episode_timeout, engine_abort, env_error"),
        ("agent/dropped_groups", "count", "groups dropped for equal rewards "
                                          "(`rollout.drop_zero_variance_groups`)"),
        ("agent/<info...>", "environment's", "any other numeric `info` your environment "
                                             "returns, summed over an episode's turns and "
                                             "averaged over episodes (the example's "
                                             "`agent/correct`)"),
    )),
    MetricGroup("Evaluation", "every `train.eval_interval` steps; `eval/` for "
                "`data.eval_path`, `eval/<set>/` for each of `data.eval_sets`", (
        ("eval/[<set>/]reward_mean", "reward", "mean reward of the evaluation responses"),
        ("eval/[<set>/]mean@<n>", "reward", "per prompt the mean reward of its n "
                                            "(`train.eval_samples`) responses, averaged over "
                                            "prompts"),
        ("eval/[<set>/]pass@<k>", "share", "unbiased pass@k (a response passes at reward >= "
                                           "`train.eval_pass_threshold`)"),
        ("eval/[<set>/]prompts", "count", "evaluation prompts"),
        ("eval/[<set>/]samples_failed", "count", "evaluation responses whose request failed "
                                                 "(left out)"),
        ("eval/[<set>/]agent/<metric...>", "as agent/*", "agent mode: the `agent/*` numbers of "
                                                         "the evaluation episodes"),
    )),
    MetricGroup("Weight sync", "SGLang engine, every step (phase 6); `delta*` with "
                "`rollout.weight_sync_delta`; `nodes`, `servers`, `restarted_servers` with "
                "servers on every node", (
        ("weight_sync/buckets", "count", "buckets streamed"),
        ("weight_sync/requests", "count", "update requests sent to the servers"),
        ("weight_sync/bytes", "bytes", "bytes sent"),
        ("weight_sync/fp8_tensors", "count", "`rollout.weight_precision: fp8` (any engine): "
                                             "weights sent as block FP8 with their scales"),
        ("weight_sync/max_bucket_bytes", "bytes", "largest bucket (bound: "
                                                  "`rollout.bucket_bytes`)"),
        ("weight_sync/peak_live_bucket_bytes", "bytes", "most bucket bytes alive at once"),
        ("weight_sync/cuda_peak_extra_bytes", "bytes", "GPU memory the colocated sync added "
                                                       "above what was allocated before it"),
        ("weight_sync/probe_max_diff", "nats", "sync probe: largest |logp| difference between "
                                               "the servers and the learner on the probe prompt "
                                               "(`rollout.verify_sync_interval`)"),
        ("weight_sync/draft_tensors_checked", "count", "sync probe of speculative servers: "
         "draft tensors whose checksum matched what the sync sent (rollout/sglang/draft_probe.py)"),
        ("weight_sync/draft_unverified", "count", "sync probe of speculative servers: servers "
         "whose draft cannot be read (SGLang 0.5.12's /weights_checker reads the target only)"),
        ("weight_sync/delta_probe_retries", "count", "1 when a delta sync failed its probe and "
                                                     "was resent in full"),
        ("weight_sync/delta", "0/1", "1 when this sync sent only what changed"),
        ("weight_sync/delta_bytes_sent", "bytes", "bytes the delta sync sent"),
        ("weight_sync/delta_bytes_full", "bytes", "bytes a full sync would have sent"),
        ("weight_sync/delta_changed_share", "share", "share of weight elements that changed"),
        ("weight_sync/delta_encode_s", "seconds", "time to encode the delta"),
        ("weight_sync/delta_apply_s", "seconds", "time the servers took to apply it"),
        ("weight_sync/delta_tensors_<kind>", "count", "tensors sent by encoding kind: same "
                                                      "(unchanged), sparse, xor, full"),
        ("weight_sync/nodes", "count", "nodes whose servers took the sync"),
        ("weight_sync/servers", "count", "servers that took the sync"),
        ("weight_sync/restarted_servers", "count", "servers their node restarted before the "
                                                   "sync"),
        ("memory/learner_offloaded_bytes", "bytes", "learner bytes this rank moved to host "
                                                    "memory for the colocated servers "
                                                    "(`rollout.offload_learner`)"),
    )),
    MetricGroup("Speculative rollouts", "every step with `rollout.speculative.algorithm: mtp` "
                "on the embedded engine (rollout/speculative_control.py); the acceptance keys "
                "only when a batch drafted", (
        ("speculative/on", "share", "share of the step's rows decoded with MTP drafting"),
        ("speculative/batch", "rows", "rows of the last decode batch (the adaptive switch's "
                                      "batch-size input)"),
        ("speculative/reason", "code", "the last decision: 0 on, 1 on to re-probe acceptance, "
                                       "2 on (adaptive off), 3 off: batch above max_batch, 4 "
                                       "off: acceptance below min_acceptance, 5 off: the head "
                                       "has no synced weights yet"),
        ("speculative/ready", "0/1", "1 once the engine's MTP head holds loaded weights"),
        ("speculative/acceptance", "share", "accepted / drafted tokens this step"),
        ("speculative/running_acceptance", "share", "the running acceptance the switch reads "
                                                    "(exponential mean over drafted batches)"),
        ("speculative/accepted_per_verify", "tokens", "accepted draft tokens per row and "
                                                      "verification"),
        ("speculative/tokens_per_verify", "tokens", "tokens emitted per row and verification "
                                                    "(accepted + 1 unless a row ended)"),
        ("speculative/verify_steps", "count", "verification forwards this step"),
    )),
    MetricGroup("Time", "every step (seconds of wall time)", (
        ("time/step", "seconds", "the whole step"),
        ("time/rollout", "seconds", "phases 1-2: generation, scoring, broadcast"),
        ("time/reference_logprobs", "seconds", "phase 3: reference forward (`algorithm.kl_coef` "
                                               "> 0)"),
        ("time/old_logprobs", "seconds", "phase 4: pi_old (recompute or audit forward)"),
        ("time/train", "seconds", "phase 5: the optimizer updates"),
        ("time/weight_sync", "seconds", "phase 6: weights to the engine (and the probe)"),
        ("time/checkpoint", "seconds", "the loop's time in the last checkpoint save and "
                                       "asynchronous-save polls since the previous row"),
    )),
)


def entries() -> list[tuple[str, str, str]]:
    """Every (key pattern, unit, meaning) row, in table order."""
    return [r for g in GROUPS for r in g.rows]


def pattern_regex(pattern: str) -> re.Pattern:
    """The regex of a key pattern (module docstring: `<x>`, `<x...>`, `[...]`)."""
    out, i = "", 0
    for m in re.finditer(r"<[^>]+>|\[|\]", pattern):
        out += re.escape(pattern[i:m.start()])
        tok = m.group(0)
        out += {"[": "(?:", "]": ")?"}.get(tok, "[^/]+(?:/[^/]+)*" if tok.endswith("...>")
                                             else "[^/]+")
        i = m.end()
    return re.compile(out + re.escape(pattern[i:]) + r"\Z")


_COMPILED: list[tuple[re.Pattern, str]] = []


def find_entry(key: str) -> str | None:
    """The first pattern of the table that names `key` (literal rows before patterns), or None."""
    if not _COMPILED:
        rows = entries()
        literal = [r[0] for r in rows if not re.search(r"[<\[]", r[0])]
        _COMPILED.extend((pattern_regex(p), p) for p in
                         literal + [r[0] for r in rows if r[0] not in literal])
    return next((p for rx, p in _COMPILED if rx.match(key)), None)
