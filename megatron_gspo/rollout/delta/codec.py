"""Delta encoding of exported weights against the engine's last acknowledged copy (pure torch).

Per tensor the smallest of three exact encodings is chosen (see `gspo_delta_loader` for the wire
format the server decodes):
- sparse: the positions whose bit pattern changed (int32, int64 above 2**31 elements) and their
  new values: (4 + element size) bytes per changed element;
- xor: the XOR of the old and new bit patterns, zlib-compressed (level 1): tried only when the
  changed share is at least `xor_min_share` (below it sparse wins and compressing costs time);
- full: the new tensor (element size bytes per element), also for non-float tensors;
and a tensor with no changed bit is not sent at all. Changes are found by comparing bit patterns,
so -0.0 vs +0.0 and NaN payloads count as changes and every decoded tensor equals the new one bit
for bit.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field

import torch

from megatron_gspo.rollout.delta.gspo_delta_loader import BITS, FILE, FORMAT, MANIFEST, PREFIX

INDEX_LIMIT = 2**31 - 1


@dataclass
class Encoded:
    """One tensor's encoding: `kind` in full | sparse | xor | same, the tensors it sends (on the
    input's device, except xor's CPU bytes), the changed element count and the bytes sent."""

    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: list[torch.Tensor] = field(default_factory=list)
    changed: int = 0
    numel: int = 0
    nbytes: int = 0


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a float tensor as integers of its width, flat. # [numel]"""
    return t.detach().contiguous().reshape(-1).view(BITS[t.dtype])


def encode_tensor(name: str, base: torch.Tensor | None, new: torch.Tensor,
                  xor_min_share: float = 0.05) -> Encoded:
    """Encode `new` against `base` (None: no base, full).

    Args:
        name: the tensor's name (HF).
        base: what the engine holds, any device (moved to `new`'s for the compare).
        new: the exported tensor.
        xor_min_share: changed share from which the XOR encoding is tried.
    Returns:
        the smallest exact encoding (kind "same": nothing to send).
    """
    new = new.detach().contiguous()
    n, esize = new.numel(), new.element_size()
    full = Encoded(name, "full", new.dtype, tuple(new.shape), [new], n, n, n * esize)
    if (base is None or new.dtype not in BITS or base.dtype != new.dtype
            or tuple(base.shape) != tuple(new.shape) or n == 0):
        return full
    nb, ob = bits(new), bits(base.to(new.device, non_blocking=True))  # [numel] each
    diff = nb != ob  # [numel]
    changed = int(diff.sum())
    if changed == 0:
        return Encoded(name, "same", new.dtype, tuple(new.shape), [], 0, n, 0)
    idx_dtype = torch.int32 if n <= INDEX_LIMIT else torch.int64
    isize = 4 if idx_dtype == torch.int32 else 8
    best = full
    if changed * (isize + esize) < best.nbytes:
        idx = diff.nonzero().reshape(-1)  # [changed]
        vals = new.reshape(-1)[idx]  # [changed]
        best = Encoded(name, "sparse", new.dtype, tuple(new.shape), [idx.to(idx_dtype), vals],
                       changed, n, changed * (isize + esize))
    if changed >= xor_min_share * n:
        x = (nb ^ ob).cpu().numpy().tobytes()
        z = zlib.compress(x, 1)
        if len(z) < best.nbytes:
            best = Encoded(name, "xor", new.dtype, tuple(new.shape),
                           [torch.frombuffer(bytearray(z), dtype=torch.uint8)], changed, n,
                           len(z))
    best.changed = changed
    return best


def pack(encoded: list[Encoded], base_token: str | None, new_token: str
         ) -> list[tuple[str, torch.Tensor]]:
    """The wire pairs of one delta bucket: the manifest, then every data tensor. Tensors of
    kind "same" are left out; an all-"same" bucket still carries its manifest (0 entries)."""
    entries, data = [], []
    for e in encoded:
        if e.kind == "same":
            continue
        ks = list(range(len(data), len(data) + len(e.parts)))
        data.extend(e.parts)
        entries.append({"name": e.name, "kind": e.kind, "dtype": str(e.dtype).removeprefix(
            "torch."), "shape": list(e.shape), "parts": ks})
    text = json.dumps({"format": FORMAT, "base": base_token, "new": new_token,
                       "tensors": entries})
    manifest = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    # one device for the whole request: a CUDA payload is pickled with SGLang's CUDA-only
    # reduction, which cannot pickle the CPU manifest or xor bytes next to it
    dev = next((t.device for t in data if t.device.type != "cpu"), None)
    if dev is not None:
        manifest, data = manifest.to(dev), [t.to(dev) for t in data]
    return [(MANIFEST, manifest)] + [(f"{PREFIX}{k}", t) for k, t in enumerate(data)]


def file_pairs(path: str) -> list[tuple[str, torch.Tensor]]:
    """The one pair that names a delta file (the disk path)."""
    return [(FILE, torch.frombuffer(bytearray(path.encode("utf-8")), dtype=torch.uint8))]


def write_file(path: str, pairs: list[tuple[str, torch.Tensor]]) -> int:
    """Write one packed bucket as a delta file (`torch.save` of {"manifest", "data"}, CPU
    tensors); returns the file's bytes."""
    import os

    manifest = bytes(pairs[0][1].cpu().numpy().tobytes()).decode("utf-8")
    data = [t.detach().cpu() for _, t in pairs[1:]]
    tmp = path + ".tmp"
    torch.save({"manifest": manifest, "data": data}, tmp)
    os.replace(tmp, path)
    return os.path.getsize(path)


def wire_bytes(pairs: list[tuple[str, torch.Tensor]]) -> int:
    """Bytes of every tensor of the pairs (manifest included)."""
    return sum(t.numel() * t.element_size() for _, t in pairs)
