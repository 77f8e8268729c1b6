"""Colocated weight sync: the learner's new weights into SGLang servers that share its GPUs,
in the memory order of SGLang's own test (test_multi_stage_release_and_resume):

    learner frees its cache, all ranks barrier -> servers resume `weights` only ->
    buckets stream (export one, send it, drop it) -> learner frees its cache, barrier ->
    servers resume `kv_cache` and `cuda_graph`

so the servers' KV cache and CUDA graphs come back only after the learner's export memory is
gone, and the whole model is never copied at once.

Which process serializes which payload entry (`serialized_named_tensors[k]` is opened by the
server's TP rank k, SGLang managers/tp_worker.py; the flattened-bucket path loads the tensors
where they are, model_executor/model_runner.py): with CUDA, server i's TP rank k runs on GPU
`i * tp + k` of the first node, and the learner rank on that GPU serializes entry k from its own
copy of the bucket, so every server rank receives handles to memory on its own GPU; the entries
are gathered to rank 0, which posts them. Without CUDA (CPU stand-in servers) rank 0
serializes every entry (host shared memory). Attached servers with CUDA (GPU placement unknown)
are refused with one line. A delta sync (`rollout.weight_sync_delta`, rank 0's `engine.delta`)
takes the same placement: rank 0 encodes each bucket, the encoded pairs are broadcast to the
ranks of the plan, and each serializes its servers' entries from its own GPU.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_gspo.rollout.engine import RolloutError
from megatron_gspo.runtime import device_ledger
from megatron_gspo.rollout.sglang.weight_sync_endpoints import LiveBytes
from megatron_gspo.rollout.weight_sync_payloads import (FLATTENED_BUCKET, flatten_bucket,
                                                        group_by_dtype, serialize)

RESUME_FIRST = ("weights",)
RESUME_AFTER = ("kv_cache", "cuda_graph")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def free_learner_cache() -> None:
    """Return the learner's cached accelerator memory to the device, then barrier all ranks.

    Memory a process frees stays in torch's caching allocator (reserved by that process, used
    as far as SGLang and the driver can tell) until `torch.cuda.empty_cache()` returns it."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    device_ledger.note("empty_cache")
    if _dist():
        dist.barrier()


def entry_ranks(
    num_servers: int, tp_size: int, attached: bool, base_gpu_id: int = 0
) -> list[list[int]] | None:
    """Learner rank that serializes each server TP rank's entry (collective).

    Args:
        num_servers, tp_size: the launched servers.
        attached: the servers were attached by URL (their GPUs are unknown).
        base_gpu_id: GPU of server 0's TP rank 0 on the first node.
    Returns:
        [server][tp rank] -> learner rank, or None when rank 0 serializes every entry (no CUDA).
    Raises:
        RolloutError (same one line on every rank) for a layout that is not handled.
    """
    me = (socket.gethostname(), local_gpu())
    infos = [me]
    if _dist():
        infos = [None] * dist.get_world_size()
        dist.all_gather_object(infos, me)
    if infos[0][1] is None:
        return None
    if attached:
        raise RolloutError(
            "rollout.weight_sync=tensor with rollout.server_urls on GPUs: which GPU each server "
            "TP rank uses is unknown, so CUDA IPC handles cannot be placed; launch the servers "
            "(rollout.colocate=true, no server_urls) or use rollout.weight_sync=distributed")
    return plan_entry_ranks(infos, num_servers, tp_size, base_gpu_id)


def local_gpu() -> int | None:
    """This rank's CUDA device (the GPU its serialized entries point to), None without CUDA
    (rank 0 then serializes every entry: host shared memory)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def plan_entry_ranks(
    infos: Sequence[tuple[str, int]], num_servers: int, tp_size: int, base_gpu_id: int = 0
) -> list[list[int]]:
    """[server][tp rank] -> the learner rank on the same GPU of the first node.

    Args:
        infos: (host, CUDA device) of every learner rank, by rank (rank 0 on the first node).
        num_servers, tp_size, base_gpu_id: server i's TP rank k runs on GPU
            base_gpu_id + i * tp_size + k of the first node.
    Raises:
        RolloutError naming the first server GPU without a learner rank.
    """
    by_gpu: dict[int, int] = {}
    for rank, (host, dev) in enumerate(infos):
        if host == infos[0][0]:
            by_gpu.setdefault(dev, rank)
    return ranks_on_server_gpus(
        by_gpu, num_servers, tp_size, base_gpu_id,
        lambda i, k, gpu: f"colocated tensor sync: server {i} TP rank {k} runs on GPU {gpu} of "
        "the first node, where no learner rank runs; the learner must cover every server GPU "
        "(or use rollout.weight_sync=distributed)")


def ranks_on_server_gpus(
    by_gpu: dict[int, int], num_servers: int, tp_size: int, base_gpu_id: int,
    missing: Callable[[int, int, int], str],
) -> list[list[int]]:
    """[server][tp rank] -> `by_gpu[gpu]` for server i's TP rank k on GPU
    base_gpu_id + i * tp_size + k; a GPU without a rank is a RolloutError `missing(i, k, gpu)`."""
    plan = []
    for i in range(num_servers):
        row = []
        for k in range(tp_size):
            gpu = base_gpu_id + i * tp_size + k
            if gpu not in by_gpu:
                raise RolloutError(missing(i, k, gpu))
            row.append(by_gpu[gpu])
        plan.append(row)
    return plan


def _send(engine: Any, entries: Any, fmt: str | None, version: int) -> str | None:
    """Rank 0 posts; every rank learns the outcome (a failure ends every rank alike)."""
    err = None
    if engine is not None:
        try:
            engine.sync(engine.apost_tensor_update(entries, fmt, version))
        except Exception as e:  # re-raised on every rank below
            err = f"{type(e).__name__}: {e}"
    if _dist():
        box = [err]
        dist.broadcast_object_list(box, src=0)
        err = box[0]
    return err


def stream_buckets(
    buckets: Iterable[list], engine: Any, version: int, plan: list[list[int]] | None,
    num_servers: int, tp_size: int,
) -> None:
    """Send every bucket (collective; `engine` on rank 0 only, paused around the stream).

    Each bucket is split per dtype; each group is flattened (byte layout), serialized by the
    ranks of `plan` (or rank 0 for every entry), posted, and dropped before the next one.
    """
    rank = dist.get_rank() if _dist() else 0
    senders = {r for row in plan for r in row} if plan is not None else {0}
    if _delta_on(engine):
        _stream_deltas(buckets, engine, version, plan, rank, senders, num_servers, tp_size)
        return
    live = LiveBytes()
    if engine is not None:
        engine.sync(engine.abegin_tensor_update())
    try:
        for bucket in buckets:
            groups = group_by_dtype(bucket)
            total = sum(t.numel() * t.element_size() for g in groups for _, t in g)
            del bucket  # the groups hold the tensors now (the exporter keeps none)
            peak = 0
            while groups:
                group = groups.pop(0)
                payload = flatten_bucket(group) if rank in senders else None
                del group
                if payload is not None:
                    peak = max(peak, live.add(payload))
                entries = _entries(payload, plan, rank, num_servers, tp_size)
                err = _send(engine, entries, FLATTENED_BUCKET, version)
                del payload, entries  # the servers have copied from the shared memory
                if err is not None:
                    raise RolloutError(f"weight sync: {err}")
            if engine is not None:
                engine.note_bucket(total, peak)
        if engine is not None:
            engine.sync(engine.afinish_tensor_update(version))
    finally:
        if engine is not None:
            engine.sync(engine.continue_generation())


def _delta_on(engine: Any) -> bool:
    """Whether rank 0's engine sends deltas (a `rollout.delta` sender as `engine.delta`),
    told to every rank."""
    sender = getattr(engine, "delta", None)
    box = [sender is not None and sender.enabled]
    if _dist():
        dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def _stream_deltas(
    buckets: Iterable[list], engine: Any, version: int, plan: list[list[int]] | None, rank: int,
    senders: set[int], num_servers: int, tp_size: int,
) -> None:
    """`stream_buckets` with the delta sync (`sglang.weight_sync_delta`): rank 0 encodes each bucket
    against its base; with a plan the encoded pairs are broadcast and every rank of the plan
    serializes its servers' entries from its own device, as for a full bucket."""
    import time

    from megatron_gspo.rollout.sglang import weight_sync_delta as delta_sync

    sender = getattr(engine, "delta", None)
    live = LiveBytes()
    if engine is not None:
        engine.sync(delta_sync.abegin_delta(engine, sender, version))
    ok = False
    try:
        for bucket in buckets:
            named = list(bucket)
            del bucket
            pairs, err = None, None
            if engine is not None:
                try:
                    engine.check_shapes(named, version)
                    pairs = sender.encode(named)
                except Exception as e:  # re-raised on every rank by _share_pairs
                    err = f"{type(e).__name__}: {e}"
            del named
            pairs, copy, count = _share_pairs(pairs, err, rank, senders,
                                              sender is not None and sender.base_kind == "copy")
            reqs = delta_sync.tensor_requests(pairs, copy) if pairs is not None else [
                (None, None)] * count
            total = sum(t.numel() * t.element_size() for _, t in pairs or ())
            del pairs
            peak, t0 = 0, time.perf_counter()
            while reqs:
                payload, fmt = reqs.pop(0)
                if payload is not None:
                    peak = max(peak, live.add(payload))
                entries = _entries(payload, plan, rank, num_servers, tp_size)
                err = _send(engine, entries, fmt, version)
                del payload, entries  # the servers have copied from the shared memory
                if err is not None:
                    raise RolloutError(f"weight sync: {err}")
            if engine is not None:
                sender.stats.apply_s += time.perf_counter() - t0
                engine.note_bucket(total, peak)
                sender.commit()
        ok = True
    finally:
        if engine is not None:
            engine.sync(delta_sync.aend_delta(engine, sender, version, ok))


def _share_pairs(
    pairs: list | None, err: str | None, rank: int, senders: set[int], copy: bool
) -> tuple[list | None, bool, int]:
    """Rank 0's encoded `pairs` to the ranks that serialize (collective): (the pairs on this
    rank's device, or None where it does not serialize; rank 0's `copy`; the number of
    requests they make). Rank 0's `err` raises on every rank. Gloo carries them in host
    memory, NCCL on each rank's current GPU."""
    meta = [(err, None, copy)]
    if rank == 0 and err is None:
        meta = [(None, [(n, t.dtype, tuple(t.shape)) for n, t in pairs or ()], copy)]
    if _dist():
        dist.broadcast_object_list(meta, src=0)
    err, names, copy = meta[0]
    if err is not None:
        raise RolloutError(f"weight sync: {err}")
    count = 1 if copy else len({dt for _, dt, _ in names})  # one flattened bucket per dtype
    if not _dist() or senders == {0}:
        return (pairs if rank == 0 else None), copy, count
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    out = []
    for i, (name, dtype, shape) in enumerate(names):
        t = pairs[i][1].to(dev).contiguous() if rank == 0 else torch.empty(
            shape, dtype=dtype, device=dev)
        dist.broadcast(t, src=0)
        out.append((name, t))
    return (out if rank in senders else None), copy, count


def _entries(
    payload: Any, plan: list[list[int]] | None, rank: int, num_servers: int, tp_size: int
) -> Sequence[Sequence[str]] | None:
    """[server][tp rank] serialized entries on rank 0 (None elsewhere)."""
    if plan is None:
        if rank != 0:
            return None
        return [[serialize(payload) for _ in range(tp_size)] for _ in range(num_servers)]
    mine = serialize(payload) if payload is not None else None
    got: list = [None] * dist.get_world_size() if rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(mine, got, dst=0)
    if rank != 0:
        return None
    return [[got[r] for r in row] for row in plan]


def in_memory_order(engine: Any, send: Callable[[], None],
                    moment: str = "weight sync") -> list[str] | None:
    """Run `send` (the weight stream, collective) between SGLang's two resume stages: free the
    learner cache + barrier, resume `weights`, send, free + barrier, resume `kv_cache` and
    `cuda_graph` (each a no-op for a region that is not released).

    Args:
        moment: the device-memory ledger's name for the stream ("delta retry": the full
            re-sync after a failed delta probe).
    Returns:
        on rank 0, the memory calls since the last sync with "stream" where `send` ran.
    """
    free_learner_cache()
    device_ledger.note("moment", moment)
    if engine is not None:
        engine.resume_memory(RESUME_FIRST)
    with device_ledger.transient("weight-sync bucket"):
        send()
    free_learner_cache()
    device_ledger.note("moment", "generation")  # the servers' KV cache and graphs come back
    if engine is None:
        return None
    n_calls = len(engine.memory_calls)
    engine.resume_memory(RESUME_AFTER)
    calls, engine.memory_calls = engine.memory_calls, []
    return [*calls[:n_calls], "stream", *calls[n_calls:]]


def colocated_sync(
    buckets: Iterable[list], engine: Any, version: int, *, num_servers: int, tp_size: int,
    attached: bool, moment: str = "weight sync",
) -> dict[str, Any]:
    """The whole tensor update in SGLang's memory order (collective over learner ranks).

    Args:
        buckets: the export stream (every rank iterates it: it is collective).
        engine: the SGLang engine on rank 0, None elsewhere.
        version: the new weight version.
        num_servers, tp_size: the servers' layout; attached: servers given by URL.
        moment: the device-memory ledger's name for the stream (`in_memory_order`).
    Returns:
        on rank 0: `sync_stats` plus `order` (the memory calls and the stream, in order);
        {} elsewhere.
    """
    plan = entry_ranks(num_servers, tp_size, attached)
    cuda = torch.cuda.is_available()
    extra: list[int] = []

    def send() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        stream_buckets(buckets, engine, version, plan, num_servers, tp_size)
        if cuda:
            extra.append(torch.cuda.max_memory_allocated() - base)

    order = in_memory_order(engine, send, moment)
    if engine is None:
        return {}
    out: dict[str, Any] = dict(engine.sync_stats)
    if extra:
        out["cuda_peak_extra_bytes"] = float(extra[0])
    out["order"] = [f"{int(out['buckets'])} buckets" if c == "stream" else c for c in order]
    return out


# ----------------------------------------------------------------------------- learner offload
# `rollout.offload_learner` (megatron.memory.offload): the learner's optimizer state leaves the GPUs
# before the servers resume their weights, its weights once the stream is sent (before the KV
# cache comes back), and everything returns after the rollout released the servers.
STATE_PARTS = ("grads", "main", "moments", "reference")
PROBE_PARTS = ("weights",)  # what the sync probe's forward reads


def offload_after_stream(learner: Any, buckets: Iterable[list]) -> Iterable[list]:
    """Yield `buckets`; after the last one the learner's weights are offloaded (every rank
    iterates the stream). The caller offloads the learner's state before the stream starts:
    before it frees the learner's cache and the servers resume their weights."""
    yield from buckets
    learner.offload(("weights",))


def learner_back(learner: Any) -> None:
    """Barrier (every node leader has released its servers), then the learner back."""
    if _dist():
        dist.barrier()
    learner.onload()


@contextlib.contextmanager
def learner_room(learner: Any, engine: Any, parts: Sequence[str], moment: str,
                 cuda: bool | None = None):
    """Around a checkpoint save (`learner_state.CHECKPOINT_PARTS`) or the sync probe's forward
    (`PROBE_PARTS`): those of `parts` that are offloaded come back and are offloaded again
    after. On GPUs the servers first release their KV cache and CUDA graphs (their weights
    stay) so that the parts fit, and take them back only once the learner has returned its
    cache to the device. `moment`: the device-memory ledger's name for the time inside."""
    away = [p for p in learner.offloaded_parts() if p in parts]
    if not away:
        device_ledger.note("moment", moment)
        yield
        return
    cuda = (torch.cuda.is_available() or device_ledger.models_gpu()) if cuda is None else cuda
    tags = ("kv_cache", "cuda_graph")
    if cuda and engine is not None:
        engine.release_memory(tags)
    if cuda and _dist():
        dist.barrier()
    device_ledger.note("moment", moment)
    learner.onload(away)
    try:
        yield
    finally:
        learner.offload(away)
        if cuda:
            free_learner_cache()  # every rank offloaded again, its cache returned
            device_ledger.note("moment", "generation")
        if cuda and engine is not None:
            engine.resume_memory(tags)
