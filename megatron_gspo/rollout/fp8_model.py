"""Block-FP8 model folders (DeepSeek-V3's 128 x 128 block format, `quant.blockfp8`; written by
`megatron-gspo convert hf-to-fp8`) served by engines that compute in BF16 / FP32 (the embedded
engine and the stand-in server: W8A16): the FP8 weights dequantized once at load, so the
engine's log-probs carry the quantization error the way an FP8 GPU engine's do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def is_block_fp8_dir(path: str | os.PathLike) -> bool:
    """A model folder whose config.json declares block-FP8 weights (`convert hf-to-fp8`)."""
    try:
        qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == "fp8" and bool(
        qc.get("weight_block_size"))


def fp8_model(path: str, dtype: torch.dtype, attn_implementation: str) -> torch.nn.Module:
    """A block-FP8 folder as a `dtype` model: built from its config without the quantization
    entry, its weights dequantized (transformers' own FP8 loader needs a GPU)."""
    import transformers

    from megatron_gspo.quant.fp8_checkpoint import dequantized_state

    config = transformers.AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._attn_implementation = attn_implementation
    net = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = dequantized_state(path, torch.float32)
    missing, unexpected = net.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(
        config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path}: the FP8 checkpoint does not fit its config (missing "
                         f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    if tied:
        net.tie_weights()
    return net.to(dtype)
