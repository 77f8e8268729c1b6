"""Colocated weight sync with servers on every node (see `multinode`): each node's servers get
their weights from the learner ranks of the same node, all nodes at once, in SGLang's memory
order (`colocated_sync.in_memory_order`).

Per sync, collectively over all learner ranks:

1. every node leader restarts its servers that died since the last sync (a failure stops every
   rank with one line naming the node), and the URLs are gathered again for rank 0's client;
2. the learner frees its cache; every leader resumes its servers' `weights`;
3. the export streams bucket by bucket; per dtype group, the serialized entries of a node are
   gathered to its leader over the node's own gloo group and posted to the node's servers (with
   CUDA, server i's TP rank k on GPU `base_gpu_id + i * tp_size + k` of node n gets the entry
   serialized by the learner rank of node n on that GPU: a CUDA IPC handle to memory on its own
   GPU, never one from another node; without CUDA the leader serializes every entry of its
   node: host shared memory of that node); all ranks agree on the outcome of every post;
4. the learner frees its cache again; every leader resumes `kv_cache` and `cuda_graph`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_gspo.rollout.multinode.colocated import (
    RESUME_AFTER,
    RESUME_FIRST,
    free_learner_cache,
    ranks_on_server_gpus,
)
from megatron_gspo.rollout.multinode.node_servers import (
    MultiNodeEngine,
    NodeLayout,
    advertised,
    agree,
    gather_layout,
    gather_urls,
    node_engine,
)
from megatron_gspo.rollout.sglang.weight_sync_endpoints import LiveBytes
from megatron_gspo.runtime import device_ledger
from megatron_gspo.rollout.weight_sync_payloads import (
    FLATTENED_BUCKET,
    flatten_bucket,
    group_by_dtype,
    serialize,
)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def node_plan(
    layout: NodeLayout, node: int, num_servers: int, tp_size: int, base_gpu_id: int = 0
) -> list[list[int]] | None:
    """[server][tp rank] -> the global rank of `node` on that server GPU, or None without CUDA
    (the node leader serializes every entry).

    Raises:
        RolloutError naming the node, server and GPU that has no learner rank.
    """
    if layout.devices[layout.leader(node)] is None:
        return None
    by_gpu: dict[int, int] = {}
    for r in layout.ranks_of(node):
        by_gpu.setdefault(layout.devices[r], r)  # type: ignore[arg-type]
    return ranks_on_server_gpus(
        by_gpu, num_servers, tp_size, base_gpu_id,
        lambda i, k, gpu: f"colocated tensor sync: node {node}'s server {i} TP rank {k} runs on "
        f"GPU {gpu} of that node, where no learner rank runs; the learner must cover every "
        "server GPU of every node")


def _node_entries(
    layout: NodeLayout, payload: Any, plan: list[list[int]] | None, num_servers: int,
    tp_size: int,
) -> Sequence[Sequence[str]] | None:
    """[server][tp rank] entries of this rank's node, on its leader (None elsewhere)."""
    leader = layout.leader(layout.node)
    if plan is None:
        if layout.rank != leader:
            return None
        return [[serialize(payload) for _ in range(tp_size)] for _ in range(num_servers)]
    mine = serialize(payload) if payload is not None else None
    ranks = layout.ranks_of(layout.node)
    got: list | None = [None] * len(ranks) if layout.rank == leader else None
    dist.gather_object(mine, got, dst=leader, group=layout.groups[layout.node])
    if got is None:
        return None
    return [[got[ranks.index(r)] for r in row] for row in plan]


def _post(layout: NodeLayout, engine: Any, entries: Any, version: int) -> None:
    """The leader posts to its node's servers; every rank raises the first node's failure."""
    err = None
    if engine is not None:
        try:
            engine.sync(engine.apost_tensor_update(entries, FLATTENED_BUCKET, version))
        except Exception as e:  # re-raised on every rank by agree()
            err = f"weight sync: node {layout.node}: {type(e).__name__}: {e}"
    agree(layout, err)


def stream_node_buckets(
    layout: NodeLayout, buckets: Iterable[list], engine: Any, version: int,
    plan: list[list[int]] | None, num_servers: int, tp_size: int,
) -> None:
    """Send every bucket to every node's servers (collective; `engine`: this node's servers on
    its leader, None elsewhere). One dtype group is alive at a time, as in `stream_buckets`."""
    senders = {r for row in plan for r in row} if plan is not None else {
        layout.leader(layout.node)}
    live = LiveBytes()
    began = None
    if engine is not None:
        try:
            engine.sync(engine.abegin_tensor_update())
        except Exception as e:
            began = f"weight sync: node {layout.node}: {type(e).__name__}: {e}"
    try:
        agree(layout, began)
        for bucket in buckets:
            groups = group_by_dtype(bucket)
            total = sum(t.numel() * t.element_size() for g in groups for _, t in g)
            del bucket
            peak = 0
            while groups:
                group = groups.pop(0)
                payload = flatten_bucket(group) if layout.rank in senders else None
                del group
                if payload is not None:
                    peak = max(peak, live.add(payload))
                entries = _node_entries(layout, payload, plan, num_servers, tp_size)
                _post(layout, engine, entries, version)
                del payload, entries
            if engine is not None:
                engine.note_bucket(total, peak)
        if engine is not None:
            engine.sync(engine.afinish_tensor_update(version))
    finally:
        if engine is not None and began is None:
            engine.sync(engine.continue_generation())


def _resume(layout: NodeLayout, own: Any, tags: Sequence[str]) -> None:
    """Every leader resumes `tags` of its servers (those released); all ranks agree."""
    err = None
    if own is not None:
        try:
            own.resume_memory(tags)
        except Exception as e:
            err = f"node {layout.node}: resuming {','.join(tags)}: {type(e).__name__}: {e}"
    agree(layout, err)


def multinode_sync(
    buckets: Iterable[list], engine: Any, version: int, *, num_servers: int, tp_size: int,
) -> dict[str, Any]:
    """The whole per-node tensor update (collective over every learner rank).

    Args:
        buckets: the export stream (every rank iterates it).
        engine: rank 0's MultiNodeEngine, another node leader's NodeServers, else None.
        version: the new weight version.
        num_servers, tp_size: servers per node and their tensor-parallel size.
    Returns:
        on rank 0: node 0's `sync_stats`, `nodes`, `servers`, `restarted_servers`, `order`
        (memory calls and stream) and `notes` (one line per restart); {} elsewhere.
    """
    layout = gather_layout()
    own = node_engine(engine)
    notes, err = [], None
    if own is not None:
        try:
            notes = own.restart_dead()
        except Exception as e:  # every rank stops with this line
            err = str(e).splitlines()[0] if str(e) else type(e).__name__
    agree(layout, err)
    urls = gather_urls(layout, advertised(own.urls) if own is not None else None)
    all_notes = gather_urls(layout, notes if own is not None else None)
    plan = node_plan(layout, layout.node, num_servers, tp_size)
    cuda = torch.cuda.is_available()
    extra: list[int] = []

    def send() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        stream_node_buckets(layout, buckets, own, version, plan, num_servers, tp_size)
        if cuda:
            extra.append(torch.cuda.max_memory_allocated() - base)

    free_learner_cache()
    device_ledger.note("moment", "weight sync")
    _resume(layout, own, RESUME_FIRST)
    with device_ledger.transient("weight-sync bucket"):
        send()
    free_learner_cache()
    device_ledger.note("moment", "generation")  # the servers' KV cache and graphs come back
    n_calls = len(own.memory_calls) if own is not None else 0
    _resume(layout, own, RESUME_AFTER)
    if not isinstance(engine, MultiNodeEngine):
        if own is not None:
            own.memory_calls = []
        return {}
    calls, own.memory_calls = own.memory_calls, []
    order = [*calls[:n_calls], "stream", *calls[n_calls:]]
    engine.client.set_urls([u for node in urls for u in node], version)
    out: dict[str, Any] = dict(own.sync_stats)
    if extra:
        out["cuda_peak_extra_bytes"] = float(extra[0])
    restarted = [n for node in all_notes for n in node]
    out.update(nodes=float(layout.nodes), servers=float(sum(map(len, urls))),
               restarted_servers=float(len(restarted)), notes=restarted)
    out["order"] = [f"{int(out['buckets'])} buckets on {layout.nodes} nodes" if c == "stream"
                    else c for c in order]
    return out
