"""Block-wise FP8 (DeepSeek-V3, arXiv 2412.19437, 128 x 128 blocks; `quant.blockfp8`) on the
weight-sync stream: the learner quantizes what the servers hold in FP8 with the same quantizer
that wrote their checkpoint, and an engine that computes in BF16 (the embedded engine, the
stand-in server: W8A16) dequantizes on receipt.

Which tensors travel as FP8 is decided by the served checkpoint's `modules_to_not_convert`
(`quant.blockfp8.modules_to_not_convert`, in its config.json): every 2-D `.weight` whose module
is not listed, so the learner and the server never disagree on a tensor. A quantized weight
travels as two tensors under the checkpoint's names, in the same bucket, weight first:
`<module>.weight` (float8_e4m3fn) and `<module>.weight_scale_inv` (float32).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from megatron_gspo.quant.blockfp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize, quantize

Bucket = list[tuple[str, torch.Tensor]]


def travels_as_fp8(name: str, tensor: torch.Tensor, not_converted: frozenset[str]) -> bool:
    """A 2-D floating `.weight` whose module the served checkpoint did not leave in BF16."""
    return (name.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point()
            and tensor.dtype != FP8_DTYPE and name[: -len(".weight")] not in not_converted)


def quantize_buckets(buckets: Iterable[Bucket], not_converted: Iterable[str],
                     stats: dict | None = None) -> Iterator[Bucket]:
    """The sync's buckets with each weight of an FP8 module replaced by its FP8 weight and
    scale (adjacent, same bucket); every other tensor passes as it is.

    Args:
        buckets: iterables of (HF name, full tensor) from the learner's export.
        not_converted: the served checkpoint's `modules_to_not_convert`.
        stats: if given, counts `fp8_tensors` and the bytes saved (`fp8_bytes_saved`).
    """
    keep = frozenset(not_converted)
    for bucket in buckets:
        out: Bucket = []
        for name, t in bucket:
            if travels_as_fp8(name, t, keep):
                q, s = quantize(t, name)
                out += [(name, q), (name + SCALE_SUFFIX, s)]
                if stats is not None:
                    stats["fp8_tensors"] = stats.get("fp8_tensors", 0) + 1
                    saved = t.numel() * t.element_size() - q.numel() - s.numel() * 4
                    stats["fp8_bytes_saved"] = stats.get("fp8_bytes_saved", 0) + saved
            else:
                out.append((name, t))
        yield out


class Fp8Receiver:
    """The receiving side of a W8A16 engine: FP8 weights and their scales replaced by the
    dequantized weight in `dtype` as soon as both halves have arrived. The halves of a pair may
    come in different calls (SGLang's flattened buckets are one request per dtype: the FP8
    weights, then the float32 scales); a half waits for the other until `unpaired` is asked.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._weights: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their scale
        self._scales: dict[str, torch.Tensor] = {}  # weight name -> scale waiting for it

    def take(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The tensors of one update that are ready to load, in order: the other tensors as
        they are, each completed pair as one dequantized weight."""
        out = []
        for n, t in named:
            if n.endswith(SCALE_SUFFIX):
                n = n[: -len(SCALE_SUFFIX)]
                self._scales[n] = t
            elif t.dtype == FP8_DTYPE:
                self._weights[n] = t
            else:
                out.append((n, t))
                continue
            if n in self._weights and n in self._scales:
                out.append((n, dequantize(self._weights.pop(n), self._scales.pop(n),
                                          self.dtype)))
        return out

    def unpaired(self) -> list[str]:
        """Names of halves still waiting (an FP8 weight without its scale, or a scale without
        its weight); clears them."""
        names = sorted([f"{n} (no {n}{SCALE_SUFFIX})" for n in self._weights]
                       + [f"{n}{SCALE_SUFFIX} (no {n})" for n in self._scales])
        self._weights.clear()
        self._scales.clear()
        return names


def dequantize_named(named: Iterable[tuple[str, torch.Tensor]],
                     dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """FP8 weight + scale pairs of one complete update replaced by the dequantized weight in
    `dtype`; other tensors pass.

    Raises:
        ValueError: a half of a pair without the other (one line naming it).
    """
    rx = Fp8Receiver(dtype)
    out = rx.take(named)
    lone = rx.unpaired()
    if lone:
        raise ValueError(f"FP8 weight update: {lone[0]}")
    return out


def has_fp8(named: Iterable[tuple[str, torch.Tensor]]) -> bool:
    """Whether an update carries block-FP8 tensors (an FP8 weight or a scale)."""
    return any(t.dtype == FP8_DTYPE or n.endswith(SCALE_SUFFIX) for n, t in named)
