"""A Hugging Face checkpoint folder -> its block-wise FP8 copy (DeepSeek-V3, arXiv 2412.19437:
e4m3 weights, 128 x 128 blocks, fp32 `weight_scale_inv`), as Qwen3-FP8 / DeepSeek-V3 ship it and
SGLang's "fp8" quant method loads it:

  - every tensor `blockfp8.quantized_names` selects: `<module>.weight` float8_e4m3fn [N, K] plus
    `<module>.weight_scale_inv` float32 [ceil(N/128), ceil(K/128)] in the same shard;
  - everything else unchanged (dtype and values);
  - config.json gains `quantization_config` {"quant_method": "fp8", "fmt": "e4m3",
    "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert":
    [...]}; tokenizer / generation / template files are copied.

The source's shard layout is kept (one output shard per input shard, the index rewritten), so
memory holds one shard at a time. Writing goes into an empty directory; the CLI
(`megatron-gspo convert hf-to-fp8`) wraps it in a temp directory renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from megatron_gspo.quant.blockfp8 import (
    modules_to_not_convert,
    quantization_config,
    quantize,
    quantized_names,
    scale_name,
)

INDEX_NAME = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt")


def num_layers_of(config: dict, where: str = "config.json") -> int:
    """The decoder layers of an HF config (`num_hidden_layers`, also under `text_config`)."""
    for c in (config, config.get("text_config") or {}):
        n = c.get("num_hidden_layers")
        if isinstance(n, int) and n > 0:
            return n
    raise ValueError(f"{where}: no positive integer num_hidden_layers (needed to keep layers BF16)")


def read_source(src: str | os.PathLike) -> tuple[dict, dict[str, list[str]]]:
    """(config, shard file name -> tensor names) of an HF safetensors folder.

    Raises:
        ValueError (one line) on a missing / bad config.json, no safetensors, a listed shard that
        is missing, or a checkpoint that is already quantized.
    """
    from safetensors import safe_open

    d = Path(src)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{cfg_path}: config.json not found")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: invalid JSON ({e})") from None
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config")
    if qc:
        raise ValueError(f"{cfg_path}: already quantized (quantization_config quant_method="
                         f"{qc.get('quant_method')!r}); convert a BF16 / FP32 checkpoint")
    index = d / INDEX_NAME
    shards: dict[str, list[str]] = {}
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        for name, f in wmap.items():
            shards.setdefault(f, []).append(name)
        for f in shards:
            if not (d / f).is_file():
                raise ValueError(f"{index}: lists shard {f}, which does not exist")
    else:
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                shards[f.name] = list(h.keys())
        if not shards:
            raise ValueError(f"{d}: no *.safetensors files and no {INDEX_NAME}")
    return config, shards


def _shapes(src: Path, shards: dict[str, list[str]]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the shard headers (no data read)."""
    from safetensors import safe_open

    out = {}
    for f, names in shards.items():
        with safe_open(str(src / f), framework="pt") as h:
            for n in names:
                out[n] = tuple(h.get_slice(n).get_shape())
    return out


def convert_shard(tensors: dict[str, torch.Tensor],
                  quantized: set[str]) -> dict[str, torch.Tensor]:
    """One shard's tensors with the selected weights replaced by (FP8 weight, scale_inv).

    Args:
        tensors: HF name -> tensor.
        quantized: the names to quantize (`blockfp8.quantized_names` of the checkpoint).
    Returns:
        a new dict: unquantized tensors as given, quantized ones plus their `*_scale_inv`.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"):
            raise ValueError(f"{name}: already an FP8 tensor / scale ({t.dtype}); convert a "
                             "BF16 / FP32 checkpoint")
        if name in quantized:
            out[name], out[scale_name(name)] = quantize(t, name)
        else:
            out[name] = t
    return out


def write_fp8_checkpoint(src: str | os.PathLike, out: str | os.PathLike,
                         keep_bf16_layers: int = 0, tp_size: int = 1) -> dict:
    """Write the block-FP8 copy of HF checkpoint `src` into directory `out` (created; must be
    empty if it exists).

    Args:
        src: HF folder (config.json, model.safetensors or an index plus shards, tokenizer).
        out: output folder (hidden files in it, such as a temp directory's owner record, are
            left alone).
        keep_bf16_layers: the first and last this many decoder layers stay unquantized.
        tp_size: the servers' tensor-parallel size (a weight whose per-rank part is off the
            128 grid stays unquantized: `blockfp8.fits_per_rank`).
    Returns:
        the `quantization_config` written into out/config.json.
    """
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    config, shards = read_source(src)
    layers = num_layers_of(config, str(src / "config.json"))
    if keep_bf16_layers < 0:
        raise ValueError(f"--keep-bf16-layers must be >= 0, got {keep_bf16_layers}")
    out.mkdir(parents=True, exist_ok=True)
    if any(not p.name.startswith(".") for p in out.iterdir()):  # hidden: owner records
        raise ValueError(f"{out}: output directory is not empty")
    shapes = _shapes(src, shards)
    quantized = quantized_names(shapes, layers, keep_bf16_layers, tp_size)
    qc = quantization_config(modules_to_not_convert(shapes, layers, keep_bf16_layers, tp_size))
    weight_map: dict[str, str] = {}
    total = 0
    for f in sorted(shards):
        tensors = convert_shard(load_file(str(src / f)), quantized)
        save_file(tensors, str(out / f), metadata={"format": "pt"})
        weight_map.update({n: f for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if (src / INDEX_NAME).is_file():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    for f in sorted(src.iterdir()):  # tokenizer, generation config, chat template, ...
        if (f.is_file() and f.name != "config.json" and not f.name.endswith(_WEIGHT_SUFFIXES)
                and not f.name.endswith(".index.json")):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc},
                                                indent=2) + "\n")
    return qc


def dequantized_state(fp8_dir: str | os.PathLike,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state dict of an FP8 folder written here, every FP8 weight dequantized to `dtype`
    (what a W8A16 engine computes with); unquantized tensors as stored."""
    from safetensors.torch import load_file

    from megatron_gspo.quant.blockfp8 import dequantize

    d = Path(fp8_dir)
    index = d / INDEX_NAME
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.is_file() else sorted(f.name for f in d.glob("*.safetensors")))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(d / f)))
    out = {}
    for name, t in state.items():
        if name.endswith("_scale_inv"):
            continue
        s = state.get(scale_name(name))
        out[name] = dequantize(t, s, dtype) if s is not None else t
    return out

