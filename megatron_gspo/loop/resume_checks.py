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

Each difference is a ConfigError naming the field and the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from megatron_gspo.config import Config, ConfigError


def _source(cfg: Config) -> tuple[str, str]:
    """(field, path) of the run's initial weights."""
    if cfg.model.load_checkpoint:
        return "model.load_checkpoint", str(cfg.model.load_checkpoint)
    return "model.path", str(cfg.model.path)


def check_resume(cfg: Config, hf_config: dict, ckpt: str | Path) -> None:
    """Refuse to resume from run checkpoint `ckpt` (step_N) with a config it was not written
    with (see the module docstring). Checkpoints of older versions record less; what they do
    not record is not compared."""
    from megatron_gspo.convert.base import ConversionError
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
    from megatron_gspo.convert.base import ConversionError
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
