"""Pinned host memory that a checkpoint leaves behind on every rank: Megatron-Core's staging
copy of the tensors the rank writes.

Megatron-Core (0.16.1 and 0.19.2, dist_checkpointing/strategies/filesystem_async.py,
`FileSystemWriterAsync.preload_tensors`) copies every tensor a rank writes with
`tensor.to("cpu", non_blocking=True)`; for a CUDA tensor torch's `_to_copy` allocates that copy
pinned, from the CachingHostAllocator (aten/src/ATen/core/CachingHostAllocator.h): each block is
rounded up to a power of two and stays in the allocator's cache when the copy is freed (nothing
in a run calls `torch.cuda.host_empty_cache`); the next save reuses the same blocks. The
synchronous save runs the same preload (`AsyncRequest.execute_sync`, reached from
`AsyncSaveShardedStrategy.save` in 0.16.1 and `TorchDistSaveShardedStrategy.save(...,
async_strategy="mcore")` in 0.19.2), so `checkpoint.async_save` on or off, and every run saves
at least at its end: from the first save on, a rank holds one pinned block per tensor it writes,
beside the offloaded learner's buffers (`megatron.memory.offload` keeps those for the run). On
CPU the copy is a no-op: the plan counts it for GPU runs.

What a rank writes (`LearnerState.save_checkpoint`: the model's and the optimizer's sharded
state dicts; Megatron-Core writes only the main replica of each, `keep_only_main_replica`):
- the weights of its TP / PP / EP shard when it is rank 0 of its DP x CP group (expert weights:
  of its expert-data-parallel group), a weight that is the same on every TP rank (norms, router)
  on TP rank 0 only; under PP the tied output-layer copy is not written; with LoRA the adapter
  factors only;
- with the distributed optimizer (`dp_reshardable`): on every rank, its slice of every DDP
  bucket as one tensor per parameter range for each of the fp32 main weight, exp_avg and
  exp_avg_sq, plus three padding tensors per gap between ranges (the 64-element alignment);
- without it, beside its weights: per parameter the fp32 main weight (bf16 / fp16 models) and
  the two Adam moments, whole.
Rank order as Megatron-Core builds its groups: tp-cp-dp-pp (dense), tp-ep-dp-pp (experts).
"""

from __future__ import annotations

from megatron_gspo.megatron.memory import plan as mp


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def staged_tensor_bytes(x, rank: int) -> list[int]:
    """Bytes of each tensor global rank `rank` writes in a checkpoint (each one pinned copy).

    Args:
        x: the plan's inputs (`report.PlanInputs`).
        rank: global rank (0 .. x.world - 1).
    Returns:
        one entry per tensor, unrounded (see `staging_bytes`).
    """
    etp = x.tp if x.etp is None else x.etp
    stage = x.tp * x.cp * x.dp
    pp_rank, r = divmod(rank, stage)
    tp_rank, dp_rank = r % x.tp, r // x.tp  # dp_rank: index in the DP x CP group
    edp = stage // (x.ep * etp)
    edp_rank = r // (etp * x.ep)
    out: list[int] = []
    for vp in range(x.vpp):
        ps = mp.chunk_params(x.dims, tp=x.tp, pp=x.pp, ep=x.ep, etp=etp, vpp=x.vpp,
                             pp_rank=pp_rank, vp_stage=vp, vocab_multiple=x.vocab_multiple,
                             lora=x.lora)
        first = pp_rank == 0 and vp == 0
        for expert, group, g_rank in ((False, x.dp * x.cp, dp_rank), (True, edp, edp_rank)):
            sel = [p for p in ps if p.expert == expert and p.trainable]
            if not sel:
                continue
            # the main replica of a weight (LoRA: of an adapter factor) and of its state
            mine = [p for p in sel if g_rank == 0 and not (p.replicated and tp_rank)
                    and not (p.shared and not first)]
            out += [b for p in mine for b in _pieces(p, x.param_bytes)]
            if x.distributed_optimizer:
                out += [4 * n for n in _dp_slice_tensors(sel, group, g_rank)]
            else:
                n_states = 2 + (x.param_bytes != 4)  # fp32 main weight (bf16 / fp16), moments
                out += [b for p in mine for _ in range(n_states) for b in _pieces(p, 4)]
    return out


def _pieces(p, nbytes: int) -> list[int]:
    """Bytes of the tensors `p` is saved as (model space): a SwiGLU fc1 as its gate and up
    halves (`apply_swiglu_sharded_factory`, also for its optimizer state)."""
    return [p.numel // 2 * nbytes] * 2 if p.halves else [p.numel * nbytes]


def _rank_key(x, rank: int) -> tuple[int, bool, int, int]:
    """What decides a rank's staged tensors: (PP rank, TP rank 0, DP x CP rank, EDP rank)."""
    etp = x.tp if x.etp is None else x.etp
    pp_rank, r = divmod(rank, x.tp * x.cp * x.dp)
    return pp_rank, r % x.tp == 0, r // x.tp, r // (etp * x.ep)


def _dp_slice_tensors(sel: list, group: int, g_rank: int) -> list[int]:
    """Elements of each optimizer tensor DP rank `g_rank` saves under the distributed optimizer
    (`DistributedOptimizer.sharded_param_state_dp_reshardable`): main weight, exp_avg and
    exp_avg_sq of each parameter range in its slice of every bucket, and of each padding gap."""
    _, spans, buckets = mp.buffer_ranges([p.numel for p in sel], [p.shared for p in sel],
                                         group, True)
    out: list[int] = []
    for k, (b0, b1) in enumerate(buckets):
        size = (b1 - b0) // group
        lo = b0 + g_rank * size
        end, shared = max((e, p.shared) for (s, e), p in zip(spans, sel, strict=True)
                          if b0 <= s < b1)
        if k + 1 < len(buckets) and not shared:  # closed by the next (shared embedding)
            end = -(-end // 64) * 64  # bucket, at that parameter's aligned start
        unpadded = end - b0
        local = sorted((max(s, lo) - lo, min(e, lo + size) - lo) for s, e in spans
                       if s < lo + size and e > lo)
        if not local:
            continue
        ends = [(0, 0), *local]
        starts = [s for s, _ in local] + [size]
        for (_, cur_end), nxt in zip(ends, starts, strict=True):  # padding between ranges
            if nxt != cur_end and g_rank * size + cur_end < unpadded:
                out += [nxt - cur_end] * 3
        out += [e - s for s, e in local for _ in range(3)]
    return out


def staging_bytes(x, rank: int) -> int:
    """Pinned host bytes global rank `rank` keeps after its first checkpoint: each staged
    tensor in a power-of-two block of torch's host allocator."""
    return sum(_pow2(n) for n in staged_tensor_bytes(x, rank))


def worst_and_node_staging(x) -> tuple[int, int]:
    """(the largest `staging_bytes` of a rank, the largest sum over the ranks of one node)."""
    by_key: dict[tuple, int] = {}
    per_rank = []
    for r in range(x.world):
        key = _rank_key(x, r)
        if key not in by_key:
            by_key[key] = staging_bytes(x, r)
        per_rank.append(by_key[key])
    nodes = [sum(per_rank[i:i + x.gpus_per_node])
             for i in range(0, x.world, x.gpus_per_node)]
    return max(per_rank), max(nodes)
