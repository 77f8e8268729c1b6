"""Stream a live Megatron-Core model's weights as Hugging Face-named tensors, in size-bounded
buckets: the input of every weight-sync path to the rollout engines and of ``mcore-to-hf``.

Each parameter is gathered to its full tensor across tensor parallelism (expert-tensor
parallelism for routed experts), routed experts are gathered across expert parallelism, and
the full tensor is split into its HF tensors with the architecture's adapter (fused QKV and
[gate; up] undone, vocabulary padding dropped). With ``gather_pipeline=True`` every pipeline
stage receives the other stages' tensors (broadcast over the pipeline group) so every rank
yields the whole model in the same order; otherwise each rank yields its own stage only.

All ranks of the model-parallel group must iterate the generator together (it is collective).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_gspo.convert import get_adapter
from megatron_gspo.convert.param_map import ConversionError, to_hf_tensors
from megatron_gspo.convert.fused_experts import SLICE_KINDS, ExpertSlices
from megatron_gspo.convert.mtp import is_mtp, without_mtp_copies
from megatron_gspo.convert.sharding import expert_index, rename_indices, tp_unshard
from megatron_gspo.megatron.io.dist_checkpoint import (
    ParamEntry,
    model_param_entries,
    normalize_hf_config,
    unwrap,
)
from megatron_gspo.megatron.lora.adapters import (
    changed_since_sync,
    effective_weight,
    is_adapted_weight,
    mark_synced,
)

Bucket = list[tuple[str, torch.Tensor]]


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _full_tensors(entry: ParamEntry, num_local_experts: int,
                  drop: frozenset = frozenset()) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, full tensor) for one local parameter; several for gathered experts
    (but those of the EP ranks in `drop`)."""
    from megatron.core import parallel_state as ps

    pm, t = entry.pm, effective_weight(entry.param)  # LoRA layers: base + scale * B A
    if pm.expert:
        group = ps.get_expert_tensor_parallel_group()
        size = ps.get_expert_tensor_parallel_world_size()
    else:
        group = ps.get_tensor_model_parallel_group()
        size = ps.get_tensor_model_parallel_world_size()
    if size > 1 and pm.tp_dim is not None:
        t = tp_unshard(_all_gather(t, group), pm)
    if not pm.expert or ps.get_expert_model_parallel_world_size() == 1:
        return [(entry.canonical, t)]
    parts = _all_gather(t, ps.get_expert_model_parallel_group())
    e_local = (
        expert_index(entry.canonical) - ps.get_expert_model_parallel_rank() * num_local_experts
    )
    return [
        (rename_indices(entry.canonical, expert=e_local + r * num_local_experts), p)
        for r, p in enumerate(parts)
        if r not in drop
    ]


def _stage_tensors(
    entries: list[ParamEntry], maps, dims, dtype, num_local_experts: int, drops=None
) -> Iterator[tuple[str, torch.Tensor]]:
    slices = ExpertSlices()  # gpt-oss: one HF tensor holds every expert of a layer
    for i, entry in enumerate(entries):
        drop = drops[i] if drops else frozenset()
        for canonical, full in _full_tensors(entry, num_local_experts, drop):
            pm = entry.pm if canonical == entry.canonical else maps[canonical]
            for name, t in zip(pm.hf, to_hf_tensors(pm, full, dims), strict=True):
                if pm.kind in SLICE_KINDS:
                    t = slices.add(pm, name, t)
                    if t is False:
                        continue
                yield name, (t if dtype is None else t.to(dtype))


def _stage_meta(entries, maps, dims, dtype, num_local_experts, ep_size, drops=None) -> list:
    """(name, shape, dtype) of every HF tensor a stage yields, in yield order (no data)."""
    out, slices = [], ExpertSlices()
    for i, entry in enumerate(entries):
        names = [entry.canonical]
        if entry.pm.expert and ep_size > 1:
            e = expert_index(entry.canonical) % num_local_experts
            names = [
                rename_indices(entry.canonical, expert=e + r * num_local_experts)
                for r in range(ep_size)
                if not drops or r not in drops[i]
            ]
        for c in names:
            pm = entry.pm if c == entry.canonical else maps[c]
            for name, shape in zip(pm.hf, pm.shapes, strict=True):
                if pm.kind in SLICE_KINDS and not slices.add(pm, name, None):
                    continue
                out.append((name, tuple(shape), dtype or entry.param.dtype))
    return out


def _mtp_for_sync(models, entries: list) -> list:
    """`entries` as a weight sync sends them when the loop marked the chunks' ``mtp_export``
    (`loop.mtp_setting`): "layers": the MTP layers' own tensors but not the embedding / head
    copies (SGLang's draft uses the target's); "none": no MTP tensor. Unmarked (conversion,
    export of a checkpoint): everything, copies included, as the checkpoint holds it."""
    modes = {getattr(unwrap(m), "mtp_export", None) for m in models}
    if modes <= {None}:
        return entries
    keep = modes != {"none"}
    return [replace(e, pm=without_mtp_copies(e.pm)) for e in entries
            if keep or not is_mtp(e.canonical)]


def export_hf_weights(
    models: list[torch.nn.Module],
    hf_config: Mapping,
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    gather_pipeline: bool = True,
    only_adapted: bool = False,
    only_mtp: bool = False,
    only_changed: bool = False,
) -> Iterator[Bucket]:
    """Yield the model's weights as buckets of (HF name, tensor) (collective).

    Args:
        models: this rank's model chunks (wrappers allowed), in virtual-stage order.
        hf_config: the HF config.json the model was built from.
        bucket_bytes: upper bound on the bytes of one bucket; a single tensor larger than
            this travels alone in a bucket of its own.
        dtype: cast to this dtype (None keeps the parameter dtype).
        gather_pipeline: yield every stage's tensors on every rank (True) or only this
            rank's stage (False).
        only_adapted: yield only the weights of LoRA-adapted layers (merged), for a
            receiver that already holds every other (frozen) weight.
        only_mtp: yield only the multi-token-prediction layers' own tensors
            (``model.layers.{num_hidden_layers + k}.*`` but their embedding / head copies): the
            draft model SGLang's NEXTN speculative decoding loads (`convert.mtp`).
        only_changed: like `only_adapted`, but only the layers (routed experts: the experts)
            whose adapters changed since the last `only_changed` export was consumed to its
            end (every adapted layer the first time); it then records the adapters as synced.
    Yields:
        lists of (name, tensor); tensors may share storage with live parameters (copy them
        before the next optimizer step if kept).
    """
    from megatron.core import parallel_state as ps

    if bucket_bytes <= 0:
        raise ConversionError(f"bucket_bytes must be positive, got {bucket_bytes}")
    cfg = normalize_hf_config(hf_config)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    maps = adapter.maps_by_mcore(dims)
    entries = [
        e
        for m in models
        for e in model_param_entries(m, maps, dims.tie_embeddings)
        if e.pm is not None and (not (only_adapted or only_changed) or is_adapted_weight(e.param))
        and (not only_mtp or is_mtp(e.canonical))
    ]
    entries = _mtp_for_sync(models, entries)
    if only_mtp and not entries and ps.get_pipeline_model_parallel_world_size() == 1:
        raise ConversionError("only_mtp: the model has no multi-token-prediction layer (build "
                              "it with mtp=True from a checkpoint that has one)")
    ep_size = ps.get_expert_model_parallel_world_size()
    nle = dims.num_experts // ep_size if dims.num_experts else 0
    pp_size = ps.get_pipeline_model_parallel_world_size()
    drops = None
    if only_changed:
        entries, drops = _changed(entries)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        own = _stage_tensors(entries, maps, dims, dtype, nle, drops)
        if pp_size == 1 or not gather_pipeline:
            yield from own
            return
        group = ps.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        me = ps.get_pipeline_model_parallel_rank()
        device = entries[0].param.device if entries else torch.device("cpu")
        for stage in range(pp_size):
            meta = [
                _stage_meta(entries, maps, dims, dtype, nle, ep_size, drops)
                if stage == me
                else None
            ]
            dist.broadcast_object_list(meta, src=ranks[stage], group=group)
            if stage == me:
                for (name, t), (mname, _, _) in zip(own, meta[0], strict=True):
                    assert name == mname, (name, mname)
                    t = t.contiguous()
                    dist.broadcast(t, src=ranks[stage], group=group)
                    yield name, t
            else:
                for name, shape, dt in meta[0]:
                    t = torch.empty(shape, dtype=dt, device=device)
                    dist.broadcast(t, src=ranks[stage], group=group)
                    yield name, t

    yield from bucketize(stream(), bucket_bytes, together=bucket_together(hf_config))
    if only_changed:  # consumed to the end: the engine now holds these adapters
        mark_synced([e.param for e in entries])


def _changed(entries: list[ParamEntry]) -> tuple[list[ParamEntry], list[frozenset]]:
    """The entries whose adapter changed on any rank that gathers them, and per entry the EP
    ranks whose (expert) tensor is unchanged (collective over TP and EP: every rank of a stage
    agrees on what travels)."""
    from megatron.core import parallel_state as ps

    # gpt-oss: one HF tensor holds every expert of a layer (ExpertSlices), so all travel
    flags = torch.tensor(
        [float(e.pm.kind in SLICE_KINDS or changed_since_sync(e.param)) for e in entries]
    )
    dense = torch.tensor([not e.pm.expert for e in entries])
    if ps.get_tensor_model_parallel_world_size() > 1 and len(entries):
        tp = flags * dense  # a dense layer's TP shards travel together
        dist.all_reduce(tp, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
        flags = torch.where(dense, tp, flags)
    ep = ps.get_expert_model_parallel_world_size()
    per_rank = (
        torch.stack(_all_gather(flags, ps.get_expert_model_parallel_group()))
        if ep > 1 and len(entries)
        else flags[None]
    )  # [ep, entries]
    keep, drops = [], []
    for i, e in enumerate(entries):
        col = per_rank[:, i]
        if col.max() > 0:
            keep.append(e)
            drops.append(
                frozenset(r for r in range(len(col)) if col[r] == 0) if e.pm.expert else frozenset()
            )
    if not keep:  # nothing changed: one dense adapted layer still travels, so that the engine
        # takes this sync's weight version (an update without a tensor sets none)
        first = next((e for e in entries if not e.pm.expert), None)
        keep, drops = ([first], [frozenset()]) if first is not None else ([], [])
    return keep, drops


def bucket_together(hf_config: Mapping) -> Callable[[str], tuple[str, int] | None]:
    """HF name -> (group key, size) or None: the tensors of the model of `hf_config` that
    SGLang's loader fuses on load (`StateDictAdapter.bucket_group`); `bucketize` keeps a group
    in one bucket, and a delta sync (`rollout.delta.DeltaSender.together`) sends all of a
    group when one of it changed."""
    cfg = normalize_hf_config(hf_config)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    return lambda name: adapter.bucket_group(name, dims)


def _units(named, together):
    """The stream as units: one (name, tensor) each, except names `together` groups (key,
    size), which are held until the group is complete and travel as one unit."""
    pending: dict = {}
    for name, t in named:
        group = together(name) if together is not None else None
        if group is None:
            yield ((name, t),)
            continue
        key, size = group
        pending.setdefault(key, []).append((name, t))
        if len(pending[key]) == size:
            yield tuple(pending.pop(key))
    for unit in pending.values():  # incomplete groups (a stage-local stream)
        yield tuple(unit)


def bucketize(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, together=None
) -> Iterator[Bucket]:
    """Group a stream of (name, tensor) into buckets of at most `bucket_bytes`, in order; a
    tensor (or group) larger than the bound travels alone in a bucket of its own.

    Args:
        named: the stream (consumed lazily: one bucket's tensors are held at a time).
        bucket_bytes: the bound (> 0).
        together: name -> (group key, group size) or None: tensors of one group always share
            a bucket (SGLang's DeepSeek loader fuses `q_a_proj` and `kv_a_proj_with_mqa` only
            when both arrive in one weight update).
    Yields:
        lists of (name, tensor).
    """
    held: list[Bucket] = [[]]  # the generator keeps no reference to a yielded bucket
    size = 0
    for unit in _units(named, together):
        nbytes = sum(t.numel() * t.element_size() for _, t in unit)
        if held[0] and size + nbytes > bucket_bytes:
            yield held.pop()
            held.append([])
            size = 0
        held[0].extend(unit)
        size += nbytes
        del unit
        if size >= bucket_bytes:
            yield held.pop()
            held.append([])
            size = 0
    if held[0]:
        yield held.pop()
