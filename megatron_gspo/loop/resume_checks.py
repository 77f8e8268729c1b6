"""What a checkpoint records, checked against the config before any of its tensors is read.

- `check_resume` (`train.resume: auto`, run by `Checkpointer.load` through the learner's
  `resume_check`): the model the checkpoint was written with (its Hugging Face config, stored
  next to the weights: `convert.sources.MODEL_INFO`), its parameter dtype, the initial weights
  it was trained from (`model.load_checkpoint` or `model.path`, by path and
  `weights_fingerprint`), and for LoRA what lora.json records (adapters or full weights, rank,
  targets, alpha, base). Without this a different model.path resumed silently (the old weights
  with another tokenizer), another alpha rescaled the adapters, and the rest failed deep inside
  Megatron's loader with a traceback.
- `check_load_checkpoint`: `model.load_checkpoint` holds the model of `model.path` (its stored
  config, and the tensor shapes of its metadata).
- `config_changes` (resume): the config the checkpoint records (`config_record`, in its
  trainer.json) against this one. A change of a key in `FREE` (how the run is executed or
  observed: length, logging, checkpointing, layout, servers, timeouts) is an event line; any
  other change (loss, learning rate, data, seed, batch shape, ...) changes what the checkpoint's
  optimizer state and data cursor mean and is refused unless `train.resume_changes` names the
  key or its section. The naming is a config field, not a CLI flag: it works as an override
  (`train.resume_changes=[optimizer.lr]`), is the same in every torchrun restart round, and is
  kept in the segment's config.yaml with what it accepted.
- `save_segment_config`: RUN_DIR/config.yaml is this segment's config; a different one of an
  earlier segment is kept as `config.N.yaml` (N = 1, 2, ...), never overwritten.

Each difference is a ConfigError naming the field and the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from megatron_gspo.config import Config, ConfigError, save_config, to_dict

# keys (exact, or a prefix ending in "." or "_") whose change leaves the checkpoint's meaning
# alone; model.path, load_checkpoint, dtype, lora: `check_resume` compares what they hold
FREE = ("train.max_steps", "train.resume", "train.resume_changes", "train.eval_",
        "train.max_skipped_steps", "train.deterministic", "logging.", "checkpoint.", "parallel.",
        "model.path", "model.load_checkpoint", "model.dtype", "model.lora.",
        "model.recompute_activations",
        "model.transformer_impl", "model.reference_offload", "optimizer.offload_outside_step",
        "data.eval_", "reward.url_", "agent.turn_timeout", "agent.episode_timeout",
        "agent.max_concurrent", "rollout.server_urls", "rollout.num_servers", "rollout.tp_size",
        "rollout.mem_fraction", "rollout.offload_learner", "rollout.host", "rollout.base_port",
        "rollout.extra_server_args", "rollout.sglang_", "rollout.verify_sync_interval",
        "rollout.max_concurrency", "rollout.request_timeout", "rollout.max_retries",
        "rollout.startup_timeout", "rollout.weight_sync", "rollout.weight_sync_",
        "rollout.router_",
        "rollout.launch_router", "rollout.server_log_dir", "rollout.backoff",
        "rollout.api_key_env", "rollout.bucket_bytes", "rollout.colocate",
        "rollout.speculative.")  # exact speculative sampling: the same distribution, drafted or not


def config_record(cfg: Config) -> dict:
    """The config as a checkpoint records it (plain JSON, in trainer.json)."""
    return json.loads(json.dumps(to_dict(cfg), default=str))


def _fields(obj, prefix: str = ""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", json.loads(json.dumps(value, default=str))


def _under(key: str, names) -> bool:
    return any(key == n or key.startswith(n if n[-1] in "._" else n + ".") for n in names)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def config_changes(cfg: Config, ckpt: str | Path) -> str:
    """Resume from `ckpt` with `cfg`: refuse (ConfigError) a change of what the checkpoint
    means that `train.resume_changes` does not name; the event line listing every change
    ("" when none, or when the checkpoint records no config: older versions)."""
    try:
        record = json.loads((Path(ckpt) / "trainer.json").read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        record = None
    now = dict(_fields(cfg))
    named = list(cfg.train.resume_changes)
    unknown = [n for n in named if not n or not any(_under(k, [n]) for k in now)]
    if unknown:
        raise ConfigError(f"train.resume_changes: {_short(unknown)} name no config key or "
                          "section (e.g. optimizer.lr, or optimizer)")
    if not isinstance(record, dict):
        return ""
    changed, refused = [], []
    for key, value in now.items():
        old = record
        for part in key.split("."):
            old = old.get(part, KeyError) if isinstance(old, dict) else KeyError
        if old is KeyError or old == value:
            continue  # not recorded (an older version's checkpoint), or the same
        what = f"{key} {_short(old)} -> {_short(value)}"
        if _under(key, FREE):
            changed.append(what)
        elif _under(key, named):
            changed.append(what + " (named in train.resume_changes)")
        else:
            refused.append((key, what))
    if refused:
        keys = ",".join(k for k, _ in refused)
        raise ConfigError(f"resume from {ckpt}: {'; '.join(w for _, w in refused[:6])}"
                          + (f" and {len(refused) - 6} more" if len(refused) > 6 else "")
                          + " would change what the checkpoint means (its optimizer state and "
                          f"data cursor were made under the old values); to accept, name them: "
                          f"train.resume_changes=[{keys}], or start a new --run-dir")
    return f"config changed since {Path(ckpt).name}: " + "; ".join(changed) if changed else ""


def save_segment_config(cfg: Config, run_dir: str | Path) -> str:
    """Write RUN_DIR/config.yaml; an earlier segment's different config.yaml is kept as
    config.N.yaml. Returns the event line ("" when nothing was kept aside)."""
    run_dir = Path(run_dir)
    path, tmp = run_dir / "config.yaml", run_dir / ".config.yaml.tmp"
    save_config(cfg, tmp)
    note = ""
    if path.is_file() and path.read_bytes() != tmp.read_bytes():
        n = 1
        while (run_dir / f"config.{n}.yaml").exists():
            n += 1
        os.replace(path, run_dir / f"config.{n}.yaml")
        note = f"config.yaml of the previous segment kept as config.{n}.yaml (this one differs)"
    os.replace(tmp, path)
    return note


def _source(cfg: Config) -> tuple[str, str]:
    """(field, path) of the run's initial weights."""
    if cfg.model.load_checkpoint:
        return "model.load_checkpoint", str(cfg.model.load_checkpoint)
    return "model.path", str(cfg.model.path)


def check_resume(cfg: Config, hf_config: dict, ckpt: str | Path) -> None:
    """Refuse to resume from run checkpoint `ckpt` (step_N) with a config it was not written
    with (see the module docstring). Checkpoints of older versions record less; what they do
    not record is not compared."""
    from megatron_gspo.convert.param_map import ConversionError
    from megatron_gspo.convert.guards import compare_configs
    from megatron_gspo.convert.sources import other_weights, read_model_info
    from megatron_gspo.megatron.lora.adapters import LoraSettings
    from megatron_gspo.megatron.lora.io import adapter_mismatch, base_mismatch, read_adapter_info

    ckpt = Path(ckpt)
    model_dir = ckpt / "model"
    field, source = _source(cfg)
    info = read_model_info(model_dir) or {}
    if info:
        try:
            compare_configs(hf_config, info["hf_config"], f"model.path {cfg.model.path}",
                            f"checkpoint {ckpt}")
        except ConversionError as e:
            raise ConfigError(f"model.path: {e}") from None
        if info.get("dtype") and info["dtype"] != cfg.model.dtype:
            raise ConfigError(f"model.dtype: {cfg.model.dtype!r}, but checkpoint {ckpt} holds "
                              f"{info['dtype']} weights; resume with model.dtype="
                              f"{info['dtype']}")
    lora, rank = read_adapter_info(model_dir), cfg.model.lora.rank
    if lora is None and rank:
        raise ConfigError(f"model.lora.rank: {rank}, but checkpoint {ckpt} holds full weights, "
                          "not LoRA adapters; resume with model.lora.rank=0")
    if lora is not None and not rank:
        raise ConfigError(f"model.lora.rank: 0, but checkpoint {ckpt} holds LoRA adapters "
                          f"(lora.json: rank {lora.get('rank')}); resume with "
                          f"model.lora.rank={lora.get('rank')}")
    if lora is not None:
        lo = cfg.model.lora
        diff = adapter_mismatch(lora, LoraSettings(rank=lo.rank, alpha=lo.alpha,
                                                   dropout=lo.dropout, targets=tuple(lo.targets)))
        if diff is not None:
            key, got, want = diff
            raise ConfigError(f"model.lora.{key}: {want!r}, but the adapters of checkpoint "
                              f"{ckpt} have {key}={got!r} (lora.json); resume with "
                              f"model.lora.{key}={got!r}")
    problem = other_weights(source, info.get("source"), info.get("source_fingerprint")) \
        if info.get("source") else (base_mismatch(lora, source) if lora else None)
    if problem:
        raise ConfigError(f"{field}: {problem} (checkpoint {ckpt}); resume with the model it "
                          "was trained from, or start a new run")


def check_load_checkpoint(cfg: Config, hf_config: dict) -> None:
    """`model.load_checkpoint` (a converted or a run checkpoint) holds the model that
    `model.path`'s config.json describes: the config stored with it and the tensor shapes of
    its metadata (no tensor is read). No-op when it is not set."""
    from megatron_gspo.convert.param_map import ConversionError
    from megatron_gspo.convert.guards import (check_config_against_shapes, checkpoint_shapes,
                                              compare_configs)
    from megatron_gspo.convert.sources import resolve_checkpoint

    path = cfg.model.load_checkpoint
    if not path:
        return
    given = f"model.path {cfg.model.path}"
    try:
        src = resolve_checkpoint(path)
        if src.stored_config is not None:
            compare_configs(hf_config, src.stored_config, given, f"model.load_checkpoint {path}")
        check_config_against_shapes(hf_config, checkpoint_shapes(src.dist_dir), given, path)
    except ConversionError as e:
        raise ConfigError(f"model.load_checkpoint: {e}") from None
