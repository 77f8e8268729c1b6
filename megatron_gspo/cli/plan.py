"""Input checks of `megatron-gspo plan CONFIG` (the per-GPU memory plan of a run config;
arithmetic in `megatron.memory.report` / `megatron.memory.plan`).

Before the arithmetic the plan checks what training checks at start: the model config
(`--model-config`, default model.path; read up to `MAX_CONFIG_BYTES`, a JSON object) and the
parallel layout on `--nodes` x `--gpus-per-node` GPUs, with training's own functions
(`loop.early_checks.check_model_layout`), so that a layout training refuses never "fits".
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_gspo.config import ConfigError

MAX_CONFIG_BYTES = 16 * 2**20  # a config.json is kilobytes; /dev/zero would never end


def checked_model_config(cfg, args) -> dict:
    """The plan's flags checked (`--gpus-per-node`, `--nodes` >= 1, `--gpu-memory` > 0), the
    model config read (`read_model_config`) and checked with the layout the way training checks
    them at start.

    Returns:
        the model config (a dict).
    Raises:
        ConfigError naming the flag, file or field.
    """
    from megatron_gspo.loop.early_checks import check_model_layout
    from megatron_gspo.megatron.memory.report import parse_bytes

    for flag, value in (("--gpus-per-node", args.gpus_per_node), ("--nodes", args.nodes)):
        if value < 1:
            raise ConfigError(f"plan: {flag}: expected an integer >= 1, got {value}")
    try:
        gpu_bytes = parse_bytes(args.gpu_memory)
    except (ValueError, OverflowError) as e:
        raise ConfigError(f"plan: --gpu-memory: {e}") from None
    if gpu_bytes < 1:
        raise ConfigError(f"plan: --gpu-memory: {args.gpu_memory!r} is no memory; expected a "
                          "size such as 80GiB")
    src = Path(args.model_config or cfg.model.path or "")
    src = src / "config.json" if src.is_dir() else src
    hf = read_model_config(src)
    check_model_layout(cfg, hf, args.nodes * args.gpus_per_node, model=str(src))
    return hf


def read_model_config(src: Path) -> dict:
    """A model's config.json as a dict: at most MAX_CONFIG_BYTES of UTF-8 JSON holding an
    object (ConfigError naming the file otherwise)."""
    try:
        with open(src, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"plan: model config {src}: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"plan: model config {src}: more than {MAX_CONFIG_BYTES >> 20} MiB, "
                          "not a config.json")
    try:
        hf = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"plan: model config {src}: not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"plan: model config {src}: a JSON {type(hf).__name__}, expected an "
                          "object of model settings")
    return hf
