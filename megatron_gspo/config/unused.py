"""Settings the rest of the config makes the run ignore: each one set to other than its default
is an error naming the field and the choice that ignores it (docs/configuration.md: "a setting
that would be ignored is an error, never a silent no-op").

- `rollout.*` fields of SGLang servers with the embedded engine (it generates in the learner's
  process: no server is launched, attached, routed, sized or synced over HTTP);
- `rollout.weight_sync_delta_threshold` unless deltas are `auto` (the only mode that reads it),
  `rollout.weight_sync_delta_base` with deltas `off`;
- every `agent.*` field while `agent.enabled` is false;
- `precision.tolerance` and `precision.recheck_interval` unless `precision.old_logprobs` is
  `auto` (they drive its switch between engine and learner log-probs), and
  `precision.audit_fraction` with `recompute` (every step computes the learner's log-probs);
- `rollout.offload_learner` unless SGLang servers are colocated (nothing else shares the GPU),
  `rollout.fp8_bf16_layers` unless `rollout.weight_precision` is `fp8`;
- `rollout.speculative.*` while its algorithm is `none` (nothing drafts), and its adaptive
  switch's `max_batch` / `min_acceptance` / `probe_interval` with `adaptive` false or with
  SGLang servers (the switch is the embedded engine's; `adaptive: true` there is refused);
- `train.eval_samples` and `train.eval_pass_k` while `train.eval_interval` is 0 (no evaluation
  runs), `logging.wandb_name` without `logging.wandb_project` (nothing is sent to W&B).
"""

from __future__ import annotations

import dataclasses

from megatron_gspo.config.schema import ConfigError

__all__ = ["SERVER_FIELDS", "check_unused"]

#: RolloutConfig fields read only where SGLang servers generate (loop/server_setup.py,
#: cli/plan_checks.py, rollout/sglang/*, rollout/multinode/*).
SERVER_FIELDS = ("server_urls", "num_servers", "tp_size", "mem_fraction", "host", "base_port",
                 "extra_server_args", "sglang_python", "sglang_device", "weight_sync",
                 "weight_sync_master", "router_url", "launch_router", "router_policy",
                 "server_log_dir", "api_key_env", "max_concurrency", "request_timeout",
                 "max_retries", "startup_timeout", "backoff")


def _changed(section, names) -> list[str]:
    """The fields of `section` among `names` whose value is not the field's default."""
    out = []
    for f in dataclasses.fields(section):
        if f.name not in names:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if getattr(section, f.name) != default:
            out.append(f.name)
    return out


def check_unused(cfg) -> None:
    """Raise ConfigError for the first setting `cfg` would ignore (see the module docstring).

    Args:
        cfg: the Config being validated.
    """
    r, p, ag = cfg.rollout, cfg.precision, cfg.agent
    rules: list[tuple[str, list[str], str]] = []  # (section, fields set, the choice ignoring)
    if r.engine == "embedded":
        rules.append(("rollout", _changed(r, SERVER_FIELDS), "rollout.engine 'embedded' (it "
                      "generates in the learner's process; no SGLang server)"))
    if r.weight_sync_delta != "auto":
        rules.append(("rollout", _changed(r, ("weight_sync_delta_threshold",)),
                      f"rollout.weight_sync_delta {r.weight_sync_delta!r} (only 'auto' reads "
                      "the threshold)"))
    if r.weight_sync_delta == "off":
        rules.append(("rollout", _changed(r, ("weight_sync_delta_base",)),
                      "rollout.weight_sync_delta 'off' (no deltas, no base)"))
    if not ag.enabled:
        names = [f.name for f in dataclasses.fields(ag) if f.name != "enabled"]
        rules.append(("agent", _changed(ag, names), "agent.enabled false"))
    if p.old_logprobs != "auto":
        rules.append(("precision", _changed(p, ("tolerance", "recheck_interval")),
                      f"precision.old_logprobs {p.old_logprobs!r} (they drive 'auto' only)"))
    if p.old_logprobs == "recompute":
        rules.append(("precision", _changed(p, ("audit_fraction",)),
                      "precision.old_logprobs 'recompute' (every step computes the learner's "
                      "log-probs)"))
    if not (r.engine == "sglang" and r.colocate):
        rules.append(("rollout", _changed(r, ("offload_learner",)),
                      f"rollout.engine {r.engine!r}" + (" and rollout.colocate false"
                                                        if r.engine == "sglang" else "")
                      + " (no SGLang server shares the learner's GPUs)"))
    if r.weight_precision != "fp8":
        rules.append(("rollout", _changed(r, ("fp8_bf16_layers",)),
                      f"rollout.weight_precision {r.weight_precision!r} (no FP8 weights)"))
    sp = r.speculative
    if sp.algorithm == "none":
        rules.append(("rollout.speculative", _changed(sp, [f.name for f in dataclasses.fields(sp)
                                                           if f.name != "algorithm"]),
                      "rollout.speculative.algorithm 'none' (nothing drafts)"))
    elif sp.adaptive is True and r.engine == "sglang":
        raise ConfigError("rollout.speculative.adaptive: true with rollout.engine 'sglang': the "
                          "adaptive switch runs in the embedded engine; SGLang servers draft "
                          "every request they get (their own --speculative-adaptive is not "
                          "wired); drop it")
    elif not (sp.adaptive if sp.adaptive is not None else r.engine == "embedded"):
        why = ("false" if sp.adaptive is False else
               "off with rollout.engine 'sglang' (the servers draft every request)")
        rules.append(("rollout.speculative", _changed(sp, ("max_batch", "min_acceptance",
                                                           "probe_interval")),
                      f"rollout.speculative.adaptive {why} (they drive the adaptive switch)"))
    t, lg = cfg.train, cfg.logging
    if t.eval_interval == 0:
        rules.append(("train", _changed(t, ("eval_samples", "eval_pass_k")),
                      "train.eval_interval 0 (no evaluation runs)"))
    if lg.wandb_project is None:
        rules.append(("logging", _changed(lg, ("wandb_name",)),
                      "logging.wandb_project unset (nothing is sent to Weights & Biases)"))
    for section, names, why in rules:
        if names:
            raise ConfigError(f"{section}.{names[0]}: not used with {why}; drop it")
