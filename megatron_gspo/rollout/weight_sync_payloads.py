"""Weight-sync payloads in SGLang's wire formats, and the learner side of the NCCL update group.

`update_weights_from_tensor` (colocated): each entry of `serialized_named_tensors` (one per
tensor-parallel rank of the server; rank k deserializes entry k) is a base64 string of a
`ForkingPickler` dump: CUDA tensors travel as IPC handles, CPU tensors as shared memory named by
file (torch's "file_system" strategy, so a server in an unrelated process can open it). With
`load_format="flattened_bucket"` the pickled object is `{"flattened_tensor": 1-D uint8 tensor,
"metadata": [...]}`: every tensor of the bucket flattened to its BYTES, concatenated, and per
tensor `name, shape, dtype, start_idx, end_idx, numel` counted in bytes; the server rebuilds a
tensor as `flat[start_idx:end_idx].view(dtype).reshape(shape)` (SGLang
srt/weight_sync/tensor_bucket.py `FlattenedTensorBucket`, srt/model_executor/model_runner.py
`_update_weights_from_flattened_bucket`). One bucket holds one dtype here, so every byte offset
is a multiple of the element size.

The server unpickles with an allow-list (SGLang srt/utils/common.py `SafeUnpickler`: builtins,
collections, torch, multiprocessing.reduction, types, ... and `sglang.srt.*` classes; anything
else is refused). The metadata objects are therefore SGLang's own `FlattenedTensorMetadata`
when sglang is importable, else `types.SimpleNamespace` records with the same attributes (both
pass the allow-list). CUDA tensors are pickled with SGLang's `monkey_patch_torch_reductions()`
reduction (the device travels as its UUID, so a server with another device numbering opens the
handle on the right GPU); that patch breaks pickling of CPU tensors (IndexError in its tuple
rewrite), so it is applied to CUDA payloads only and CPU payloads always use torch's own tensor
reduction. Pickling CUDA tensors without sglang importable is refused with one clear error.

`update_weights_from_distributed` (disaggregated): the learner joins a process group of
world size 1 + sum(server tp sizes) as rank 0 and broadcasts each tensor; servers receive them
after `init_weights_update_group`. `init_learner_update_group` builds the learner's side with the
same rendezvous the server uses (TCP store, key prefix = group name), the learner hosting the
store explicitly (under torchrun the `tcp://` rendezvous would make it a client too).
"""

from __future__ import annotations

import base64
import importlib
import io
import pickle
import pickletools
import types
from collections.abc import Iterable, Iterator
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

FLATTENED_BUCKET = "flattened_bucket"


class WeightSyncError(RuntimeError):
    """A weight-sync payload cannot be built or decoded (message names the cause)."""


def _sglang() -> dict[str, Any] | None:
    """SGLang's serializer, bucket class and CUDA reduction patch, or None without sglang."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError:
        return None
    patch = None
    for mod in ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch"):
        try:  # the module moved between versions
            patch = importlib.import_module(mod).monkey_patch_torch_reductions
            break
        except (ImportError, AttributeError):
            continue
    return {"serializer": MultiprocessingSerializer, "bucket": FlattenedTensorBucket,
            "patch": patch}


def sglang_importable() -> bool:
    """True when SGLang's serializer and bucket classes import in this environment."""
    return _sglang() is not None


def _has_cuda_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(_has_cuda_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_cuda_tensor(v) for v in obj)
    return False


class _HostPickler(ForkingPickler):
    """ForkingPickler with torch's own tensor reduction, even after SGLang's patch replaced
    it globally (the patched reduction only handles CUDA tensors)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from torch.multiprocessing import reductions

        original = getattr(reductions, "_reduce_tensor_original", None)
        if original is not None:
            for cls, fn in list(self.dispatch_table.items()):
                if fn is reductions.reduce_tensor:
                    self.dispatch_table[cls] = original


_SHM_MANAGER = {"started": False}


def start_shm_manager_detached() -> None:
    """Start torch's `torch_shm_manager` (the daemon behind "file_system" shared memory) with
    its stderr on /dev/null, once per process. It inherits the starting process's stderr and
    lives while any process holds the shared memory, i.e. until the SGLang server that received
    a CPU payload exits: started plainly, a pipe reading this process's output (`... 2>&1 |
    tee log`) would never see its end. Call with the "file_system" strategy set; fd 2 points to
    /dev/null only while the manager starts."""
    if _SHM_MANAGER["started"]:
        return
    import os
    import sys

    sys.stderr.flush()
    devnull, saved = os.open(os.devnull, os.O_WRONLY), os.dup(2)
    try:
        os.dup2(devnull, 2)
        torch.empty(1).share_memory_()  # the first file_system allocation starts the manager
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    _SHM_MANAGER["started"] = True


def serialize(obj: Any) -> str:
    """ForkingPickler dump as base64 text (SGLang `MultiprocessingSerializer.serialize(obj,
    output_str=True)`); CUDA payloads go through SGLang's device-UUID reduction.

    Raises:
        WeightSyncError: CUDA tensors in `obj` and sglang not importable.
    """
    buf = io.BytesIO()
    if _has_cuda_tensor(obj):
        sg = _sglang()
        if sg is None or sg["patch"] is None:
            raise WeightSyncError(
                "tensor weight sync of CUDA tensors needs sglang importable in the learner's "
                "environment (its CUDA IPC reduction); install sglang there or use "
                "rollout.weight_sync=distributed")
        sg["patch"]()
        ForkingPickler(buf).dump(obj)
    else:  # shared memory by file name: any process may open it (no fd passing, no authkey)
        import torch.multiprocessing as tmp

        before = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            start_shm_manager_detached()
            _HostPickler(buf).dump(obj)
        finally:
            tmp.set_sharing_strategy(before)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


# The server's allow-list (facts of SGLang srt/utils/common.py `SafeUnpickler`): a global is
# loaded only when its module starts with one of these prefixes and it is not denied.
ALLOWED_MODULE_PREFIXES = (
    "builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
    "weakref.", "torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.",
    "pickletools.", "peft.", "transformers.", "huggingface_hub.",
    "sglang.srt.weight_sync.tensor_bucket.", "sglang.srt.model_executor.model_runner.",
    "sglang.srt.layers.", "sglang.srt.utils.", "torch_npu.",
)
DENIED_GLOBALS = frozenset({
    ("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"), ("os", "system"),
    ("subprocess", "Popen"), ("subprocess", "run"), ("codecs", "decode"),
    ("types", "CodeType"), ("types", "FunctionType"),
})


def prefix_refusal(module: str, name: str) -> str | None:
    """Why SGLang 0.5.12's `SafeUnpickler` refuses the global `module.name` (outside its module
    prefixes, or denied), or None when it loads it. 0.5.23's exact list: `sglang.versions`."""
    if (module, name) not in DENIED_GLOBALS and (module + ".").startswith(
            ALLOWED_MODULE_PREFIXES):
        return None
    return (f"Blocked unsafe class loading ({module}.{name}): not in SGLang's SafeUnpickler "
            "allow-list")


class AllowListUnpickler(pickle.Unpickler):
    """Unpickler that loads only the globals SGLang 0.5.12's `SafeUnpickler` loads."""

    def find_class(self, module: str, name: str) -> Any:
        why = prefix_refusal(module, name)
        if why is None:
            return super().find_class(module, name)
        raise WeightSyncError(why)


def deserialize(data: str | bytes) -> Any:
    """Inverse of `serialize`, with the server's allow-list (what SGLang does per entry)."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return AllowListUnpickler(io.BytesIO(data)).load()


def payload_error(entry: str, refusal=prefix_refusal) -> str | None:
    """Why SGLang's server would die on this serialized entry, or None: text that is not
    base64, or a pickled global its unpickler refuses (both raise in its scheduler, which ends
    the server). The pickle is scanned, not loaded.

    Args:
        entry: one `serialized_named_tensors` entry.
        refusal: (module, name) -> why the served release refuses that global, or None
            (`sglang.versions.unpickler_refusal`; default 0.5.12's module prefixes).
    """
    try:
        data = base64.b64decode(entry, validate=True)
    except (ValueError, TypeError) as e:
        return f"entry is not base64 text ({e})"
    strings: list[Any] = []  # what each opcode pushed, as far as globals need it
    memo: dict[int, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
                strings.append(arg)
            elif op.name in ("BINGET", "LONG_BINGET", "GET"):
                strings.append(memo.get(int(arg)))
            elif op.name == "MEMOIZE":
                memo[len(memo)] = strings[-1] if strings else None
            elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = strings[-1] if strings else None
            elif op.name in ("GLOBAL", "INST", "STACK_GLOBAL"):
                module, name = (arg.split(" ", 1) if op.name != "STACK_GLOBAL"
                                else (strings[-2], strings[-1]) if len(strings) > 1
                                else (None, None))
                if not (isinstance(module, str) and isinstance(name, str)):
                    return (f"Blocked unsafe class loading ({module}.{name}): not in "
                            "SGLang's SafeUnpickler allow-list")
                why = refusal(module, name)
                if why:
                    return why
                strings.append(None)
            else:
                strings.append(None)
    except ValueError as e:
        return f"entry is not a pickle ({e})"
    return None


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """One dtype's tensors as {"flattened_tensor": uint8 [bytes], "metadata"} (byte offsets).

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
    named = [(n, t.detach().contiguous()) for n, t in named]
    sg = _sglang()
    if sg is not None:
        b = sg["bucket"](named_tensors=named)
        return {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}
    metas, flats, start = [], [], 0
    for name, t in named:
        flat = t.reshape(-1).view(torch.uint8)  # [bytes]
        n = flat.numel()
        metas.append(types.SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype,
                                           start_idx=start, end_idx=start + n, numel=n))
        flats.append(flat)
        start += n
    return {"flattened_tensor": torch.cat(flats), "metadata": metas}


def unflatten_bucket(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Rebuild (name, tensor) pairs from a flattened-bucket dict (the server's side):
    `flat[start_idx:end_idx].view(dtype).reshape(shape)` over uint8 bytes."""
    try:
        flat, metas = payload["flattened_tensor"], payload["metadata"]
    except (KeyError, TypeError) as e:
        raise ValueError("flattened bucket payload lacks 'flattened_tensor'/'metadata'") from e
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flattened bucket: flattened_tensor must be 1-D uint8 bytes, got "
                         f"{flat.dtype} {tuple(flat.shape)}")
    out = []
    for m in metas:
        size = torch.Size(m.shape).numel() * torch.empty((), dtype=m.dtype).element_size()
        if not (0 <= m.start_idx and m.end_idx <= flat.numel()
                and m.end_idx - m.start_idx == m.numel == size):
            raise ValueError(f"flattened bucket: bad byte range for {m.name}")
        out.append((m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)))
    return out


def group_by_dtype(
    bucket: Iterable[tuple[str, torch.Tensor]],
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split one bucket into per-dtype lists, keeping first-seen order."""
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in bucket:
        groups.setdefault(t.dtype, []).append((name, t))
    return list(groups.values())


def tensor_update_payloads(
    bucket: Iterable[tuple[str, torch.Tensor]], tp_size: int, flattened: bool = True
) -> tuple[list[dict[str, Any]], list[Any]]:
    """JSON bodies (without flush/version fields) for /update_weights_from_tensor, every TP
    rank's entry serialized in this process (CPU shared memory, or CUDA handles to this
    process's GPU).

    Args:
        bucket: (HF name, full tensor) pairs.
        tp_size: the server's tensor-parallel size; each rank gets its own serialization of
            the same tensors.
        flattened: one flattened bucket per dtype (else a plain list of named tensors).
    Returns:
        (bodies, keep_alive): request bodies, and the payloads that must stay alive until the
        server has answered (their memory is shared with it).
    """
    bodies, keep = [], []
    for payload, fmt in bucket_payloads(bucket, flattened):
        keep.append(payload)
        entries = [serialize(payload) for _ in range(tp_size)]
        bodies.append({"serialized_named_tensors": entries, "load_format": fmt})
    return bodies, keep


def bucket_payloads(
    bucket: Iterable[tuple[str, torch.Tensor]], flattened: bool = True
) -> Iterator[tuple[Any, str | None]]:
    """(payload, load_format) per request of one bucket, made one at a time: one flattened
    bucket per dtype, or one plain named-tensor list. A dtype group's tensors are released
    once its payload is made; the generator keeps no reference to a yielded payload."""
    if not flattened:
        named = [(n, t.detach().contiguous()) for n, t in bucket]
        if named:
            yield named, None
        return
    groups = group_by_dtype(bucket)
    while groups:
        yield flatten_bucket(groups.pop(0)), FLATTENED_BUCKET


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
    master_address:master_port, keys prefixed with the group name. Rank 0 hosts the store
    itself (a TCPStore server): torch's `tcp://` rendezvous would not under torchrun, whose
    workers carry TORCHELASTIC_USE_AGENT_STORE=True and so make every rank a store client
    (torch/distributed/rendezvous.py `_create_c10d_store`), leaving no one to host it.

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
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:  # host the store here, whatever torchrun's variables say
        store = dist.TCPStore(master_address, master_port, world_size, is_master=True,
                              timeout=timeout, wait_for_workers=False)
    else:
        store, rank, world_size = next(c10d.rendezvous(
            f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
