"""The run configuration: the root `Config` (one field per section of `config/sections.py`),
its cross-field rules (`Config.validate()`), and loading from YAML.

    cfg = load_config("examples/tiny/config.yaml", overrides=["train.max_steps=5"])

Unknown keys, wrong types and out-of-range values fail with the dotted path of the field.
`save_config` writes the resolved config back out (loading that file again gives an equal
config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_gspo.config.ranges import check_ranges
from megatron_gspo.config.schema import ConfigError, apply_overrides, from_dict, to_dict
from megatron_gspo.config.sections import (
    LORA_TARGETS,
    TOKEN_ADVANTAGE_LOSSES,
    AgentConfig,
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    MoeConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from megatron_gspo.config.unused import check_unused
from megatron_gspo.config.yaml_strict import StrictYAMLError, brief, strict_load


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)

    def validate(self) -> "Config":
        """Cross-field checks; raises ConfigError naming the fields involved."""
        p, a = self.parallel, self.algorithm
        if p.sequence_parallel and p.tensor == 1:
            raise ConfigError("parallel.sequence_parallel: needs parallel.tensor > 1")
        if p.virtual_pipeline is not None and p.pipeline == 1:
            raise ConfigError("parallel.virtual_pipeline: needs parallel.pipeline > 1")
        lo, hi = a.clip_range()
        if a.loss in ("gspo", "gspo_token") and (lo >= 0.1 or hi >= 0.1):
            raise ConfigError(f"algorithm.eps_low/eps_high: {lo}/{hi} are GRPO-sized; GSPO "
                              "sequence ratios need clip ranges around 3e-4/4e-4")
        if a.loss in ("gspo", "gspo_token", "grpo") and lo >= 1:
            raise ConfigError(f"algorithm.eps_low: expected float < 1, got {lo}")
        if a.loss == "cispo" and lo > 1:
            raise ConfigError(f"algorithm.eps_low: expected float <= 1 for cispo (1 = no lower "
                              f"bound on the IS weight), got {lo}")
        self._validate_family()
        if self.train.prompts_per_step * self.rollout.group_size < a.mini_batches:
            raise ConfigError("algorithm.mini_batches: more mini-batches than sequences per step "
                              f"({self.train.prompts_per_step} x {self.rollout.group_size})")
        if self.optimizer.min_lr > self.optimizer.lr:
            raise ConfigError("optimizer.min_lr: must not exceed optimizer.lr")
        if self.moe.routing_replay == "r3" and not self.moe.engine_routing:
            raise ConfigError("moe.routing_replay: 'r3' replays the engine's routing but "
                              "moe.engine_routing is false")
        if self.rollout.weight_sync_delta != "off" and self.rollout.engine != "sglang":
            raise ConfigError("rollout.weight_sync_delta: for SGLang engines (the embedded "
                              "engine shares the learner's process); use off")
        if self.rollout.engine == "sglang" and not self.rollout.server_urls and not self.model.path:
            raise ConfigError("model.path: required to launch SGLang servers")
        if self.agent.advantage == "turn" and a.loss not in TOKEN_ADVANTAGE_LOSSES:
            raise ConfigError(f"agent.advantage: 'turn' needs per-token advantages, which "
                              f"algorithm.loss {a.loss!r} does not take; use one of "
                              f"{', '.join(TOKEN_ADVANTAGE_LOSSES)}")
        unused = [name for name, on in (
            ("algorithm.kl_estimator", a.kl_estimator != "k3"),
            ("algorithm.kl_in", a.kl_in != "loss"),
            ("model.reference_path", self.model.reference_path is not None),
            ("model.reference_offload", self.model.reference_offload)) if on]
        if a.kl_coef == 0 and unused:
            raise ConfigError(f"{unused[0]}: set while algorithm.kl_coef is 0 (KL off, no "
                              "reference model is built); set kl_coef > 0 or drop it")
        self._validate_lora()
        check_unused(self)  # a rollout, agent or precision setting the choices ignore
        check_ranges(self)  # clip inside the ratio bound, a correction that runs, reward.url
        if self.reward.url is not None and self.agent.enabled:
            raise ConfigError("reward.url: not used with agent.enabled (the environment scores "
                              "the episodes); drop it or score inside the environment")
        t = self.train
        if t.eval_samples > 1 and t.eval_temperature == 0:
            raise ConfigError("train.eval_samples: more than one response per eval prompt needs "
                              "train.eval_temperature > 0 (greedy responses are all the same)")
        too_big = [k for k in t.eval_pass_k if not 1 <= k <= t.eval_samples]
        if too_big:
            raise ConfigError(f"train.eval_pass_k: {too_big[0]} is outside [1, "
                              f"train.eval_samples={t.eval_samples}]")
        for name in self.data.eval_sets:
            if not name or "/" in name or name != name.strip():
                raise ConfigError(f"data.eval_sets: set name {brief(name)} must be non-empty, "
                                  "without '/' or surrounding spaces")
        r = self.rollout
        if r.mode == "sync":
            unused = [n for n, on in (
                ("rollout.max_staleness", r.max_staleness != 1),
                ("rollout.update_in_flight", r.update_in_flight != "continue"),
                ("rollout.chunk_tokens", r.chunk_tokens != 64)) if on]
            if unused:
                raise ConfigError(f"{unused[0]}: set while rollout.mode is 'sync' (used only by "
                                  "asynchronous rollouts); set rollout.mode=async or drop it")
        elif r.engine == "sglang" and r.colocate:
            raise ConfigError("rollout.mode: 'async' needs the SGLang servers on GPUs of their "
                              "own (generation overlaps training); set rollout.colocate=false")
        elif r.over_sample != 1.0:
            raise ConfigError("rollout.over_sample: not used with rollout.mode 'async' (the "
                              "producer replaces discarded groups as it goes); drop it")
        if a.kl_in == "reward" and self.agent.enabled and self.agent.advantage == "turn":
            raise ConfigError("algorithm.kl_in: 'reward' is not used by turn-level advantages "
                              "(agent.advantage 'turn'); use kl_in 'loss'")
        return self

    def _validate_lora(self) -> None:
        """`model.lora`: known targets; no setting that LoRA off (rank 0) or on would ignore."""
        lo, m = self.model.lora, self.model
        bad = [t for t in lo.targets if t not in LORA_TARGETS]
        if bad:
            raise ConfigError(f"model.lora.targets: unknown target {brief(bad[0])}; known: "
                              f"{', '.join(LORA_TARGETS)}")
        if lo.rank == 0:
            changed = [n for n, on in (("alpha", lo.alpha != 16.0), ("dropout", lo.dropout != 0),
                                       ("targets", lo.targets != ["qkv", "proj", "fc1", "fc2"]))
                       if on]
            if changed:
                raise ConfigError(f"model.lora.{changed[0]}: set while model.lora.rank is 0 "
                                  "(LoRA off); set a rank or drop it")
            return
        if not lo.targets or len(set(lo.targets)) != len(lo.targets):
            raise ConfigError("model.lora.targets: needs at least one target, each once")
        if m.reference_path is not None or m.reference_offload:
            which = "reference_path" if m.reference_path else "reference_offload"
            raise ConfigError(f"model.{which}: not used with model.lora (the KL reference is "
                              "the base model, the learner with its adapters off); drop it")

    def _validate_family(self) -> None:
        """A setting the chosen loss, correction or reward option would ignore is an error."""
        a, p, rw, sapo = self.algorithm, self.precision, self.reward, self.algorithm.loss == "sapo"
        rules = (  # (field, set to a non-default value, used by the current choice, which choice)
            ("algorithm.eps_low", a.eps_low is not None, not sapo, "algorithm.loss 'sapo'"),
            ("algorithm.eps_high", a.eps_high is not None, not sapo, "algorithm.loss 'sapo'"),
            ("algorithm.sapo_tau_pos", a.sapo_tau_pos != 1.0, sapo, f"algorithm.loss {a.loss!r}"),
            ("algorithm.sapo_tau_neg", a.sapo_tau_neg != 1.05, sapo, f"algorithm.loss {a.loss!r}"),
            ("algorithm.grpo_aggregation", a.grpo_aggregation != "seq-mean-token-mean",
             a.loss == "grpo", f"algorithm.loss {a.loss!r}"),
            ("precision.mask_bound", p.mask_bound != 1e-3, p.correction == "mask", "correction"),
            ("precision.tis_cap", p.tis_cap != 2.0, p.correction in ("tis", "mis"), "correction"),
            ("precision.icepop_low", p.icepop_low != 0.5, p.correction == "icepop", "correction"),
            ("precision.icepop_high", p.icepop_high != 5.0, p.correction == "icepop",
             "correction"),
            ("reward.overlong_penalty", rw.overlong_penalty != 1.0, rw.overlong_buffer > 0,
             "reward.overlong_buffer 0 (soft overlong punishment off)"),
            ("reward.overlong_filter", rw.overlong_filter, not self.agent.enabled,
             "agent.enabled (episodes end on turns, not at rollout.max_new_tokens)"),
            ("reward.overlong_buffer", rw.overlong_buffer > 0, not self.agent.enabled,
             "agent.enabled (episodes end on turns, not at rollout.max_new_tokens)"))
        for name, is_set, used, why in rules:
            if is_set and not used:
                why = f"precision.correction {p.correction!r}" if why == "correction" else why
                raise ConfigError(f"{name}: not used with {why}; drop it")
        if rw.overlong_buffer > self.rollout.max_new_tokens:
            raise ConfigError(f"reward.overlong_buffer: {rw.overlong_buffer} exceeds "
                              f"rollout.max_new_tokens={self.rollout.max_new_tokens}")


def config_from_dict(data: dict | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build and validate a Config from a raw mapping plus `a.b=c` overrides."""
    data = apply_overrides(Config, data or {}, list(overrides))
    return from_dict(Config, data).validate()


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML file (None = defaults), apply overrides, validate.

    Args:
        path: YAML file path.
        overrides: `section.key=value` strings (value parsed as YAML).
    Returns:
        the validated Config.
    """
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise ConfigError(f"{p}: line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                              f"offset {e.start})") from None
        try:
            data = strict_load(text) or {}
        except StrictYAMLError as e:
            raise ConfigError(f"{p}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
    return config_from_dict(data, overrides)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (round-trips through `load_config`)."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
