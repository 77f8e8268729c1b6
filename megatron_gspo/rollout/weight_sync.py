"""Weight-sync payloads in SGLang's wire formats, and the learner side of the NCCL update group.

`update_weights_from_tensor` (colocated): each entry of `serialized_named_tensors` (one per
tensor-parallel rank of the server) is a base64 string of a `ForkingPickler` dump (CUDA tensors
travel as IPC handles, CPU tensors as shared memory). With `load_format="flattened_bucket"` the
pickled object is `{"flattened_tensor": 1-D tensor, "metadata": [FlattenedTensorMetadata]}`, one
bucket per dtype. When SGLang is importable its own serializer and bucket classes are used (so
its unpickler accepts the payload); otherwise an equivalent implementation of the same format.

`update_weights_from_distributed` (disaggregated): the learner joins a process group of
world size 1 + sum(server tp sizes) as rank 0 and broadcasts each tensor; servers receive them
after `init_weights_update_group`. `init_learner_update_group` builds the learner's side with the
same rendezvous the server uses (TCP store, key prefix = group name).
"""

from __future__ import annotations

import base64
import importlib
import io
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

FLATTENED_BUCKET = "flattened_bucket"


@dataclass
class FlattenedTensorMetadata:
    """Where one named tensor lives inside a flattened bucket (same fields as SGLang's)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _sglang_classes() -> tuple[Any, Any] | None:
    """(MultiprocessingSerializer, FlattenedTensorBucket) from SGLang, or None without it."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError:
        return None
    for mod in ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch"):
        try:  # makes CUDA IPC handles device-independent (module moved between versions)
            patch = importlib.import_module(mod).monkey_patch_torch_reductions
        except (ImportError, AttributeError):
            continue
        patch()
        break
    return MultiprocessingSerializer, FlattenedTensorBucket


def serialize(obj: Any) -> str:
    """ForkingPickler dump as base64 text (SGLang `MultiprocessingSerializer.serialize(obj,
    output_str=True)`)."""
    sg = _sglang_classes()
    if sg is not None:
        return sg[0].serialize(obj, output_str=True)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def deserialize(data: str | bytes) -> Any:
    """Inverse of `serialize` (what the server does with each entry)."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return ForkingPickler.loads(data)


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """One dtype's tensors as {"flattened_tensor", "metadata"} (SGLang's flattened_bucket).

    Args:
        named: (name, tensor) pairs, all of one dtype.
    Returns:
        the dict SGLang's server expects after deserialization.
    """
    if not named:
        raise ValueError("cannot flatten an empty weight bucket")
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) != 1:
        raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, dtypes))}")
    sg = _sglang_classes()
    if sg is not None:
        b = sg[1](named_tensors=named)
        return {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}
    metas, flats, idx = [], [], 0
    for name, t in named:
        n = t.numel()
        metas.append(FlattenedTensorMetadata(name, t.shape, t.dtype, idx, idx + n, n))
        flats.append(t.detach().reshape(-1))
        idx += n
    return {"flattened_tensor": torch.cat(flats), "metadata": metas}


def unflatten_bucket(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Rebuild (name, tensor) pairs from a flattened-bucket dict (the server's side)."""
    try:
        flat, metas = payload["flattened_tensor"], payload["metadata"]
    except (KeyError, TypeError) as e:
        raise ValueError("flattened bucket payload lacks 'flattened_tensor'/'metadata'") from e
    out = []
    for m in metas:
        if m.end_idx > flat.numel() or m.end_idx - m.start_idx != m.numel:
            raise ValueError(f"flattened bucket: bad index range for {m.name}")
        out.append((m.name, flat[m.start_idx : m.end_idx].reshape(m.shape).to(m.dtype)))
    return out


def group_by_dtype(
    bucket: Iterable[tuple[str, torch.Tensor]],
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split one bucket into per-dtype lists, keeping first-seen order."""
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in bucket:
        groups.setdefault(t.dtype, []).append((name, t.contiguous()))
    return list(groups.values())


def tensor_update_payloads(
    bucket: Iterable[tuple[str, torch.Tensor]], tp_size: int, flattened: bool = True
) -> tuple[list[dict[str, Any]], list[Any]]:
    """JSON bodies (without flush/version fields) for /update_weights_from_tensor.

    Args:
        bucket: (HF name, full tensor) pairs.
        tp_size: the server's tensor-parallel size; each rank gets its own serialization of
            the same tensors (a shared-memory handle may be opened only once per copy).
        flattened: one flattened bucket per dtype (else a plain list of named tensors).
    Returns:
        (bodies, keep_alive): request bodies, and the tensors that must stay alive until the
        server has answered (their memory is shared with it).
    """
    bodies, keep = [], []
    if flattened:
        for group in group_by_dtype(bucket):
            payload = flatten_bucket(group)
            keep.append(payload)
            entries = [serialize(payload) for _ in range(tp_size)]
            bodies.append({"serialized_named_tensors": entries, "load_format": FLATTENED_BUCKET})
    else:
        named = [(n, t.contiguous()) for n, t in bucket]
        if named:
            keep.append(named)
            entries = [serialize(named) for _ in range(tp_size)]
            bodies.append({"serialized_named_tensors": entries, "load_format": None})
    return bodies, keep


def decode_tensor_update(body: dict[str, Any], tp_rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Server side of /update_weights_from_tensor: this rank's (name, tensor) pairs."""
    entries = body.get("serialized_named_tensors")
    if not isinstance(entries, list) or len(entries) <= tp_rank:
        raise ValueError("serialized_named_tensors must be a list with one entry per TP rank")
    obj = deserialize(entries[tp_rank])
    if body.get("load_format") == FLATTENED_BUCKET:
        return unflatten_bucket(obj)
    if body.get("load_format") not in (None, "direct"):
        raise ValueError(f"unsupported load_format {body.get('load_format')!r}")
    return [(str(n), t) for n, t in obj]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16 (SGLang turns it back with getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


def init_learner_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
    rank: int = 0,
    timeout_s: float = 600.0,
) -> Any:
    """Join a weight-update process group outside the default group (learner = rank 0).

    The rendezvous matches SGLang's `init_weights_update_group`: a TCP store at
    master_address:master_port, keys prefixed with the group name.

    Args:
        master_address, master_port: TCP store address (rank 0 hosts it).
        world_size: 1 + sum of the servers' tp sizes.
        group_name: shared name of the group.
        backend: "nccl" on GPUs, "gloo" on CPU.
        rank: this process's rank (0 for the learner).
        timeout_s: rendezvous / collective timeout.
    Returns:
        the torch.distributed ProcessGroup.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
