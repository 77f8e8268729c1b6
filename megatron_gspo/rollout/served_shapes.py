"""The served checkpoint's tensor shapes, and why a sync would end SGLang's server.

SGLang's weight loaders assert each tensor's shape against the parameter it loads into, and
Qwen3's `load_weights` (SGLang srt/models/qwen3.py) looks the fused name of a stacked part
(q_proj, k_proj, v_proj, gate_proj, up_proj) up without a check: either ends the server. These
checks run on the learner side before anything is sent.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["STACKED_PARTS", "checkpoint_shapes", "shape_error", "stacked_part"]


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape of a local Hugging Face checkpoint (the safetensors headers only;
    None when `model_dir` is not a readable local directory of safetensors files)."""
    import json
    import os
    import struct

    try:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    except (OSError, TypeError):
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for f in files:
            with open(os.path.join(model_dir, f), "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            shapes.update({k: tuple(v["shape"]) for k, v in header.items()
                           if k != "__metadata__"})
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return shapes or None


#: The per-projection weight names SGLang's models fuse on load (stacked_params_mapping of
#: models/llama.py, qwen2.py, qwen3.py, qwen3_moe.py: qkv_proj, gate_up_proj).
STACKED_PARTS = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")


def stacked_part(name: str) -> str | None:
    """The stacked part `name` holds (".q_proj." etc.), or None."""
    return next((p for p in STACKED_PARTS if p in name), None)


def shape_error(named: Iterable[tuple[str, torch.Tensor]],
                shapes: dict[str, tuple[int, ...]] | None) -> str | None:
    """Why SGLang's server would die loading `named`, or None: the first tensor whose shape
    differs from the served checkpoint's tensor of that name (its weight loader asserts the
    shape), or a name the checkpoint lacks that holds a stacked part (q_proj, k_proj, v_proj,
    gate_proj, up_proj), which Qwen3's load_weights looks up unchecked. Other unknown names are
    skipped by SGLang (a silent no-op the sync probe catches)."""
    if not shapes:
        return None
    for name, t in named:
        want = shapes.get(name)
        if want is None and stacked_part(name):
            return (f"{name} is not a tensor of the served checkpoint and names a stacked "
                    f"part ({stacked_part(name)}): SGLang's Qwen3 load_weights looks the fused "
                    "name up without a check (models/qwen3.py), a KeyError that ends the "
                    "server; not sent")
        if want is not None and tuple(t.shape) != want:
            return (f"{name} has shape {tuple(t.shape)} but the served checkpoint's is {want} "
                    "(SGLang's weight loader would assert and end the server); not sent")
    return None
