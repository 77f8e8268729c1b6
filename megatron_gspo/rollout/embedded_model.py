"""The transformers causal LM the embedded engine (`rollout.embedded`) samples from: built from a
model directory (block-FP8 directories dequantized, W8A16), an HF config dict (random init) or
a ready module, in eval mode, in the requested dtype and attention backend.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_gspo.rollout.fp8_model import fp8_model, is_block_fp8_dir

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_hf_model(
    model: str | os.PathLike | dict[str, Any] | torch.nn.Module,
    dtype: str = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A causal LM from a directory (config + weights), an HF config dict (random init) or as is.

    Args:
        model: directory path, config dict (with `model_type`), or a ready module.
        dtype: "float32", "bfloat16" or "float16".
        device: torch device string.
        attn_implementation: transformers attention backend ("sdpa" or "eager"); "sdpa" falls
            back to "eager" for architectures transformers has no SDPA path for (gpt-oss: its
            attention sinks).
    Returns:
        the model in eval mode.
    """
    import transformers

    if dtype not in _DTYPES:
        raise ValueError(f"rollout dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    torch_dtype = _DTYPES[dtype]
    if isinstance(model, torch.nn.Module):
        net = model
    elif isinstance(model, dict):
        cfg = dict(model)
        if "model_type" not in cfg:
            raise ValueError("HF config dict for the embedded engine has no 'model_type'")
        config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        if attn_implementation == "sdpa" and not _supports_sdpa(config.architectures):
            attn_implementation = "eager"
        config._attn_implementation = attn_implementation
        net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"embedded engine model directory not found: {path}")
        if attn_implementation == "sdpa" and not _supports_sdpa(
                transformers.AutoConfig.from_pretrained(path).architectures):
            attn_implementation = "eager"
        if is_block_fp8_dir(path):  # W8A16: the FP8 weights dequantized, computed in `dtype`
            return fp8_model(path, torch_dtype, attn_implementation).to(device=device).eval()
        net = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, attn_implementation=attn_implementation
        )
    return net.to(device=device, dtype=torch_dtype).eval()


def _supports_sdpa(archs: list[str] | None) -> bool:
    """The (first) architecture of a config has a transformers SDPA attention path."""
    import transformers

    cls = getattr(transformers, archs[0], None) if archs else None
    return bool(getattr(cls, "_supports_sdpa", True))
