"""Block-wise FP8 weights: the format of DeepSeek-V3 (arXiv 2412.19437, section 3.3.2: "block-wise
quantization", 128 x 128 weight blocks) and of the Qwen3 / DeepSeek FP8 checkpoints that SGLang's
"fp8" quant method loads with ``weight_block_size: [128, 128]``.

A 2-D weight W [N, K] (nn.Linear layout, out x in) becomes
  - ``weight``           [N, K]  torch.float8_e4m3fn (e4m3, max finite 448, no inf)
  - ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]  float32, one per 128 x 128 block
with, per block b (the last row / column blocks are partial: the reference zero-pads them, which
changes no amax, and crops the result):
  amax_b      = max(|W_b|) in float32, floored at 1e-4 (so an all-zero block has a finite scale;
                SGLang's `bf16_to_block_fp8_128` and DeepGEMM's `per_block_cast_to_fp8` do the same)
  scale_inv_b = amax_b / 448
  q_b         = round-to-nearest-even(W_b / scale_inv_b) as e4m3
and dequantization is q_b * scale_inv_b. Pure torch; leading batch dims ([E, N, K]) are allowed.

Which tensors are quantized (`quantized_names`): the 2-D linear weights (`*proj*`) of the
attention and MLP / expert blocks of decoder layers (`is_quantized`). Embeddings, lm_head, norms,
routers / gates, biases, fused 3-D expert tensors and the first / last `keep_bf16_layers` layers
stay in their dtype, and so does a module SGLang fuses (q/k/v -> qkv_proj, gate/up ->
gate_up_proj, a layer's experts -> FusedMoE) when a fused part has rows that are not a multiple
of 128 (SGLang's block FP8 needs whole blocks per part: fp8.py `validate_block_quant_shapes`,
`Fp8MoEMethod.create_weights`), all its parts together. The module paths of the 2-D weights that
stay are the `modules_to_not_convert` SGLang reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4
SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERTS = re.compile(r"^(.*\.experts)\.\d+\.")
# SGLang's fused linears (quantization/utils.py _FALLBACK_FUSED_SHARDS): part -> fused module
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
# SGLang's row-parallel linears (the input dimension split over TP ranks)
_ROW_PARALLEL = {"o_proj", "down_proj", "out_proj"}
# leaves never quantized although they may look like projections: DSA indexer's head weights
_KEEP_LEAVES = {"weights_proj"}


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise ValueError (one line naming `name`) when `x` holds inf or nan."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        n_nan = int(torch.isnan(x).sum())
        raise ValueError(f"{name}: {int(bad.sum())} non-finite values ({n_nan} nan, "
                         f"{int(bad.sum()) - n_nan} inf) in a tensor of shape {tuple(x.shape)}; "
                         "cannot quantize to FP8")


def quantize(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 quantization of a weight.

    Args:
        weight: [..., N, K] floating tensor (bf16 / fp16 / fp32), any device.
        name: the tensor's name for error messages.
    Returns:
        (q [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N/128), ceil(K/128)] float32).
    """
    if weight.dim() < 2 or not weight.is_floating_point() or weight.dtype == FP8_DTYPE:
        raise ValueError(f"{name}: block FP8 needs a floating tensor of >= 2 dims, got "
                         f"{weight.dtype} of shape {tuple(weight.shape)}")
    *lead, n, k = weight.shape
    nb, kb = _blocks(n), _blocks(k)
    x = weight.reshape(-1, n, k).to(torch.float32).contiguous()  # [B, N, K]
    if (n, k) != (nb * BLOCK, kb * BLOCK):  # partial edge blocks: zero padding, cropped below
        xp = x.new_zeros((x.shape[0], nb * BLOCK, kb * BLOCK))
        xp[:, :n, :k] = x
        x = xp
    xv = x.view(x.shape[0], nb, BLOCK, kb, BLOCK)  # [B, nb, 128, kb, 128]
    amax = xv.abs().amax(dim=(2, 4), keepdim=True)  # [B, nb, 1, kb, 1]; nan / inf propagate
    if not bool(torch.isfinite(amax).all()):
        check_finite(weight, name)
    sf = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (xv / sf).to(FP8_DTYPE).view(x.shape[0], nb * BLOCK, kb * BLOCK)[:, :n, :k]
    return (q.reshape(*lead, n, k).contiguous(),
            sf.reshape(*lead, nb, kb).contiguous())


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize`: q * scale_inv per block (in float32), cast to `dtype`.

    Args:
        q: [..., N, K] float8_e4m3fn.
        scale_inv: [..., ceil(N/128), ceil(K/128)] float32.
        dtype: output dtype.
    Returns:
        [..., N, K] tensor of `dtype`.
    """
    *lead, n, k = q.shape
    if tuple(scale_inv.shape) != (*lead, _blocks(n), _blocks(k)):
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a "
                         f"weight of shape {tuple(q.shape)} in {BLOCK}x{BLOCK} blocks (want "
                         f"{(*lead, _blocks(n), _blocks(k))})")
    s = scale_inv.to(torch.float32).repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return (q.to(torch.float32) * s[..., :n, :k]).to(dtype)


def scale_name(weight_name: str) -> str:
    """`model.layers.0.mlp.up_proj.weight` -> `model.layers.0.mlp.up_proj.weight_scale_inv`."""
    return weight_name + SCALE_SUFFIX


def layer_index(name: str) -> int | None:
    """Decoder layer of a parameter name (`...layers.7.mlp...` -> 7), None outside layers."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def kept_layers(num_layers: int, keep_bf16_layers: int = 0) -> set[int]:
    """The first and last `keep_bf16_layers` decoder layers (they stay BF16)."""
    if keep_bf16_layers < 0:
        raise ValueError(f"keep_bf16_layers must be >= 0, got {keep_bf16_layers}")
    n = min(keep_bf16_layers, num_layers)
    return set(range(n)) | set(range(num_layers - n, num_layers))


def is_linear_weight(name: str, shape: Iterable[int]) -> bool:
    """A 2-D `*proj*.weight` of an attention or MLP / expert block of a decoder layer."""
    if not name.endswith(".weight") or len(tuple(shape)) != 2 or layer_index(name) is None:
        return False
    leaf = name[: -len(".weight")].rsplit(".", 1)[-1]
    return "proj" in leaf and leaf not in _KEEP_LEAVES and "norm" not in leaf


def is_quantized(name: str, shape: Iterable[int], num_layers: int,
                 keep_bf16_layers: int = 0) -> bool:
    """Whether parameter `name` of `shape` is stored as block FP8.

    Args:
        name: HF parameter name (`model.layers.3.self_attn.q_proj.weight`).
        shape: its shape.
        num_layers: the model's decoder layers (layers at or past it, e.g. MTP, stay BF16).
        keep_bf16_layers: the first and last this many layers stay BF16.
    """
    if not is_linear_weight(name, shape):
        return False
    i = layer_index(name)
    return i < num_layers and i not in kept_layers(num_layers, keep_bf16_layers)


def fused_module(name: str) -> str | None:
    """The module SGLang loads weight `name` into when it fuses it with others, None if not:
    `...self_attn.k_proj.weight` -> `...self_attn.qkv_proj`, `...mlp.experts.3.down_proj.weight`
    -> `...mlp.experts`."""
    m = _EXPERTS.match(name)
    if m:
        return m.group(1)
    module, _, leaf = name.removesuffix(".weight").rpartition(".")
    return f"{module}.{_FUSED[leaf]}" if leaf in _FUSED and module else None


def fits_per_rank(name: str, shape: Iterable[int], tp_size: int = 1) -> bool:
    """Whether each of `tp_size` server ranks holds whole 128 blocks of weight `name`
    (SGLang's fp8.py `validate_block_quant_shapes`): a row-parallel weight (o_proj, down_proj,
    out_proj: the input split) needs K / tp on the grid, a column-parallel one (the output
    split) N / tp, and a fused part its own rows even on one rank. A part that does not split
    evenly (K/V heads replicated over ranks) is counted as not fitting."""
    n, k = tuple(shape)[-2:]
    leaf = name.removesuffix(".weight").rpartition(".")[2]
    size = k if leaf in _ROW_PARALLEL else n
    if tp_size <= 1:
        return leaf not in _FUSED or n % BLOCK == 0
    return size % tp_size == 0 and (size // tp_size) % BLOCK == 0


def quantized_names(shapes: Mapping[str, Iterable[int]], num_layers: int,
                    keep_bf16_layers: int = 0, tp_size: int = 1) -> set[str]:
    """The parameters of a checkpoint stored as block FP8: `is_quantized`, less each weight
    whose per-rank part is off the 128 grid at the servers' `tp_size` (`fits_per_rank`), and
    with it every other part of its fused module (`fused_module`).

    Args:
        shapes: parameter name -> shape of the whole checkpoint.
        num_layers, keep_bf16_layers: as for `is_quantized`.
        tp_size: the serving engine's tensor-parallel size.
    """
    chosen = {n for n, s in shapes.items() if is_quantized(n, s, num_layers, keep_bf16_layers)}
    misfit = {n for n in chosen if not fits_per_rank(n, shapes[n], tp_size)}
    groups = {fused_module(n) for n in misfit} - {None}
    return {n for n in chosen if n not in misfit and fused_module(n) not in groups}


def modules_to_not_convert(shapes: Mapping[str, Iterable[int]], num_layers: int,
                           keep_bf16_layers: int = 0, tp_size: int = 1) -> list[str]:
    """Module paths (no `.weight`) of the 2-D weights that stay BF16: what SGLang's Fp8Config
    reads as `modules_to_not_convert` / `ignored_layers` (lm_head, embeddings, routers, the
    projections of kept layers and of fused modules that do not fit whole blocks), sorted.

    Args:
        shapes: parameter name -> shape of the whole checkpoint.
        num_layers, keep_bf16_layers: as for `is_quantized`.
        tp_size: as for `quantized_names`.
    """
    quantized = quantized_names(shapes, num_layers, keep_bf16_layers, tp_size)
    return sorted(n.removesuffix(".weight") for n, s in shapes.items()
                  if n.endswith(".weight") and len(tuple(s)) == 2 and n not in quantized)


def quantization_config(not_converted: list[str]) -> dict:
    """The `quantization_config` of config.json for a block-FP8 checkpoint."""
    return {**QUANTIZATION_CONFIG, "weight_block_size": [BLOCK, BLOCK],  # a fresh list
            "modules_to_not_convert": list(not_converted)}
