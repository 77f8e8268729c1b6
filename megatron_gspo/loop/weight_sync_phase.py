"""The weight-sync phase of a step: the learner's new weights into the rollout engine (embedded,
tensor sync into colocated servers on one or every node, or the NCCL/gloo broadcast to remote
servers), with the learner offloaded around it when it shares the GPUs with SGLang, every
bucket checked finite, and the sync verified by served log-probs on a schedule
(`rollout.verify_sync_interval`). Called by `train.py`; returns metrics as a flat dict.
"""

from __future__ import annotations

import torch

from megatron_gspo.config import Config
from megatron_gspo.data.sample import Sample
from megatron_gspo.loop import fp8_rollout
from megatron_gspo.loop import server_setup as servers
from megatron_gspo.loop.build import DTYPES
from megatron_gspo.rollout.engine import RolloutError
from megatron_gspo.runtime import device_ledger, faults

def colocated_sglang(cfg: Config) -> bool:
    return cfg.rollout.engine == "sglang" and cfg.rollout.colocate


def released_after_rollout(cfg: Config) -> tuple[str, ...] | None:
    """SGLang memory regions released after each rollout (None: all of them).

    With LoRA only the KV cache and the CUDA graphs are released: the servers' weights stay.
    SGLang keeps its weights in a torch_memory_saver region without CPU backup (the default of
    `--enable-weights-cpu-backup`), so a released weights region comes back as fresh,
    uninitialised memory on resume; a full sync makes it whole again, but LoRA sends only the
    adapted layers after the first sync. Keeping the weights costs the servers' weight bytes
    on the GPU while the learner trains (`megatron-gspo plan` adds them to the training
    moment), whereas a full sync or a CPU backup would move every weight each step. A delta
    sync (`rollout.weight_sync_delta`) keeps them for the same reason: a release would force a
    full sync every step."""
    keep = cfg.model.lora.rank or cfg.rollout.weight_sync_delta != "off"  # deltas need them too
    return ("kv_cache", "cuda_graph") if keep else None


def offloading(cfg: Config) -> bool:
    """`rollout.offload_learner` in effect (`rollout.colocated_sync` does the moves)."""
    from megatron_gspo.megatron.memory.report import offload_learner_enabled

    return offload_learner_enabled(cfg)


def delta_sender(engine, cfg: Config, hf_config: dict):
    """The engine's `rollout.delta` sender (made on first use; None when deltas are off, with
    another engine than SGLang, or off rank 0). Tensors SGLang fuses on load (the exporter's
    bucket groups of the model of `hf_config`, e.g. DeepSeek's two attention
    down-projections) are sent together when one of them changed."""
    r = cfg.rollout
    if engine is None or r.engine != "sglang" or r.weight_sync_delta == "off":
        return None
    if getattr(engine, "delta", None) is None:
        from megatron_gspo.megatron.io.weight_export import bucket_together
        from megatron_gspo.rollout.delta.sender import DeltaSender

        engine.delta = DeltaSender(r.weight_sync_delta, r.weight_sync_delta_threshold,
                                   r.weight_sync_delta_base,
                                   together=bucket_together(hf_config))
    return engine.delta


def sync_weights(learner, engine, hf_config: dict, cfg: Config, version: int,
                 event=None, retry: bool = True, moment: str = "weight sync") -> dict:
    """Export the learner's weights (collective over all ranks) into the rollout engine,
    streamed one bucket at a time (`rollout.bucket_bytes`). Colocated SGLang follows SGLang's
    memory order (see `rollout.colocated_sync`).

    With `rollout.weight_sync_delta` the servers get only what changed (`sglang.weight_sync_delta`);
    a delta sync whose probe fails is followed at once by a full sync of the same version
    (`retry`), probed again, in the room a normal sync gets (`_sync_room`).

    Args:
        event: optional callable taking one line for the run's events.log (rank 0).
        retry: a failed probe after a delta sync triggers one full sync.
        moment: the device-memory ledger's name for the stream of colocated servers.
    Returns:
        `weight_sync/*` metrics (rank 0 of an SGLang engine; {} otherwise).
    """
    from megatron_gspo.megatron.io.weight_export import export_hf_weights
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    r = cfg.rollout
    dtype = DTYPES[r.dtype] if r.engine == "embedded" else DTYPES[cfg.model.dtype]
    offload = offloading(cfg)
    if offload:  # optimizer state away before the servers resume; weights after the stream
        from megatron_gspo.rollout.multinode.colocated import STATE_PARTS, offload_after_stream

        learner.onload(["weights"] if "weights" in learner.offloaded_parts() else [])
        learner.offload(STATE_PARTS)
    # LoRA: the frozen weights reach the engine once (this process's first sync); after that
    # only the adapted layers' merged weights change, so only those whose adapters changed
    # since the last sync are sent (routed experts: per expert; export_hf_weights only_changed)
    only = getattr(learner, "lora", None) is not None and getattr(learner, "synced_base", False)
    buckets = _finite(export_hf_weights(learner.chunks, hf_config, bucket_bytes=r.bucket_bytes,
                                        dtype=dtype, only_changed=only), version)
    fp8 = {} if fp8_rollout.enabled(cfg) else None  # the servers hold block FP8: quantized here
    if fp8 is not None:
        from megatron_gspo.quant.fp8_stream import quantize_buckets

        buckets = quantize_buckets(buckets, fp8_rollout.modules_kept(cfg, hf_config), fp8)
    if offload:
        buckets = offload_after_stream(learner, buckets)
    delta = delta_sender(engine, cfg, hf_config)
    deltas = r.engine == "sglang" and r.weight_sync_delta != "off"  # every rank: one path
    if _tensor_sync(cfg) and not servers.colocated_on_every_node(cfg):
        # full or delta (rank 0's engine.delta): each server GPU's entries from the learner
        # rank on that GPU, servers attached by URL on GPUs refused (colocated.entry_ranks)
        from megatron_gspo.rollout.multinode.colocated import colocated_sync

        st = colocated_sync(buckets, engine, version, num_servers=len(r.server_urls) or
                            r.num_servers, tp_size=r.tp_size, attached=bool(r.server_urls),
                            moment=moment)
    elif deltas:  # broadcast or disk: the engine's own path (rank 0 encodes every bucket)
        st = {}
        if colocated_sglang(cfg):
            from megatron_gspo.rollout.multinode.colocated import in_memory_order

            st["order"] = in_memory_order(engine, lambda: _send(engine, buckets, version),
                                          moment)
        else:
            if engine is not None:
                engine.resume_memory()
            _send(engine, buckets, version)
        if engine is not None:  # the stream's counts, as the full colocated sync reports them
            st.update(engine.sync_stats)
    elif _tensor_sync(cfg):  # on every node (no deltas there: loop.server_setup), all at once
        from megatron_gspo.rollout.multinode.weight_sync_nodes import multinode_sync

        st = multinode_sync(buckets, engine, version, num_servers=r.num_servers,
                            tp_size=r.tp_size)
    else:
        def send() -> None:
            if engine is None:
                for _ in buckets:  # other ranks take part in the gathers
                    pass
            elif isinstance(engine, EmbeddedEngine):
                engine.load_buckets(buckets, version)
            else:
                engine.update_weights(buckets, version)

        st = {}
        if colocated_sglang(cfg):  # NCCL broadcast into servers on the learner's GPUs
            from megatron_gspo.rollout.multinode.colocated import in_memory_order

            st["order"] = in_memory_order(engine, send, moment)
        else:
            if engine is not None:
                engine.resume_memory()  # no-op unless released after the rollout
            send()
    device_ledger.note("sglang_weights_sent", not only)
    if fp8:
        st["fp8_tensors"] = fp8["fp8_tensors"]
    if delta is not None:
        st.update(delta.stats.metrics())
        if event is not None and not delta.stats.delta:
            event(f"weight sync v{version}: full ({delta.stats.reason})")
    if r.engine == "sglang" and r.verify_sync_interval and version % r.verify_sync_interval == 0:
        diff, failed = _probe(learner, engine, cfg, version, deltas and retry)
        if failed is not None:  # the delta sync was not verified: a full one, probed again
            if delta is not None:
                delta.invalidate("sync probe mismatch")
            if event is not None:
                event(f"weight sync v{version}: {failed}; sending it in full")
            _sync_room(engine, cfg)
            learner.synced_base = False  # LoRA: every weight (the partial sync's records aside)
            out = sync_weights(learner, engine, hf_config, cfg, version, event, retry=False,
                               moment="delta retry")
            out["weight_sync/delta_probe_retries"] = 1.0
            return out
        st["probe_max_diff"] = diff
        if r.speculative.algorithm == "mtp":  # rank 0's draft check (others: zeros)
            st.update({"draft_tensors_checked": 0.0, "draft_unverified": 0.0,
                       **(getattr(engine, "draft_probe", None) or {})})
    order = st.pop("order", None)
    for note in st.pop("notes", []):  # servers restarted by their node (multi-node colocated)
        if event is not None:
            event(f"weight sync v{version}: {note}")
    if event is not None and order:
        peak = (f"; peak live bucket bytes {int(st['peak_live_bucket_bytes'])} (largest bucket "
                f"{int(st['max_bucket_bytes'])}, bound {r.bucket_bytes})"
                ) if st.get("peak_live_bucket_bytes") else ""  # measured by the tensor paths
        event(f"weight sync v{version}: " + " -> ".join(order) + peak)
    learner.synced_base = True
    out = {f"weight_sync/{k}": float(v) for k, v in st.items()}
    if offload:  # what this rank's learner gave back to the servers
        out["memory/learner_offloaded_bytes"] = float(learner.offloaded_bytes())
    return out


def verify_sync(learner, engine, cfg: Config, version: int) -> float:
    """Verify a weight sync (collective): rank 0's servers generate from a fixed probe prompt,
    the learner recomputes the log-probs of what they generated, and a difference above
    `PROBE_TOLERANCE` of the served dtype is one RolloutError naming the sync. Returns the
    largest difference (rank 0; 0.0 elsewhere). An offloaded learner is brought back for the
    recompute (its weights only) the way a checkpoint brings it back (`colocated.learner_room`)."""
    from megatron_gspo.rollout.sglang.weight_sync_endpoints import (PROBE_PROMPT, PROBE_TOLERANCE,
                                                      check_sync_probe)

    from megatron_gspo.megatron.learner import broadcast_samples

    tdist = torch.distributed
    lead = engine is not None and (not tdist.is_initialized() or tdist.get_rank() == 0)
    probes, samples = None, None
    if lead:
        try:  # a failed probe reaches every rank (the others wait in the broadcast)
            probes = engine.sync(engine.aprobe_servers(cfg.rollout.temperature))
            if hasattr(engine, "acheck_draft"):  # speculative servers: the draft's tensors
                engine.draft_probe = engine.sync(engine.acheck_draft(version))  # draft_probe.py
            samples = [Sample(prompt_ids=list(PROBE_PROMPT), response_ids=list(ids),
                              rollout_logprobs=list(lps), index=i)
                       for i, (_, ids, lps) in enumerate(probes)]
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            samples = (f"weight sync to version {version}: the sync probe failed: "
                       f"{type(e).__name__}: {e}")
    samples = broadcast_samples(samples)
    if isinstance(samples, str):
        raise RolloutError(samples)
    from megatron_gspo.rollout.multinode.colocated import PROBE_PARTS, learner_room

    # an offloaded learner (rollout.offload_learner) brings its weights back for the
    # recompute: on GPUs the servers first release their KV cache and CUDA graphs
    with learner_room(learner, engine, PROBE_PARTS, "sync probe"):
        mine = learner.forward_logprobs(samples, temperature=cfg.rollout.temperature)
    if not lead:
        return 0.0
    return check_sync_probe(version, probes, mine,
                            fp8_rollout.probe_tolerance(cfg, PROBE_TOLERANCE))


def _sync_room(engine, cfg: Config) -> None:
    """Before the full re-sync that follows a failed delta probe (collective): colocated
    servers give back what they give back after a rollout (`released_after_rollout`: the KV
    cache and CUDA graphs that the probe's `learner_room` resumed), and every rank waits for
    that before its learner brings its weights back, so that the re-sync runs in the room of a
    normal sync, not next to a full KV cache. The ledger's moment is "delta retry"."""
    if colocated_sglang(cfg):
        if engine is not None:
            engine.release_memory(released_after_rollout(cfg))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    device_ledger.note("moment", "delta retry")


def _send(engine, buckets, version: int) -> None:
    """Rank 0 sends through its engine; the other ranks only take part in the export."""
    if engine is None:
        for _ in buckets:
            pass
    else:
        engine.update_weights(buckets, version)


def _probe(learner, engine, cfg: Config, version: int, retry: bool) -> tuple[float, str | None]:
    """`verify_sync` (collective); with `retry` a mismatch comes back as its message on every
    rank instead of raising (rank 0 decides and broadcasts it)."""
    failed = None
    try:
        diff = verify_sync(learner, engine, cfg, version)
    except RolloutError as e:
        if not retry:
            raise
        diff, failed = 0.0, str(e)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [failed]
        torch.distributed.broadcast_object_list(box, src=0)
        failed = box[0]
    return diff, failed


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Every element of every (non-empty) tensor finite, from one read of each and no
    temporary of a tensor's size. Fast path: one sum per tensor (a NaN or an infinity anywhere
    makes the sum NaN or infinite; a sum is about 1.5x cheaper than `aminmax` on CPU, and this
    runs on every sync). A non-finite sum can also come from finite weights whose sum
    overflows, so that case is decided exactly by each tensor's minimum and maximum (finite
    exactly when all its elements are: NaN propagates into both, -inf / +inf are the minimum /
    maximum when present)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    sums = [t.sum() for t in tensors]
    try:
        if bool(torch.isfinite(torch.stack(sums)).all()):
            return True
    except RuntimeError:  # tensors on several devices
        if all(bool(torch.isfinite(s)) for s in sums):
            return True
    return all(bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()) for t in tensors)


def _finite(buckets, version: int):
    """The exported buckets, checked on the way: a non-finite weight stops the run naming the
    tensor and the update that made it (every rank sees the same gathered tensors)."""
    from megatron_gspo.runtime.rundir import RunError

    for i, bucket in enumerate(buckets):
        floats = [(name, t) for name, t in bucket if t.is_floating_point()]
        if floats and not _all_finite([t for _, t in floats]):
            name = next(n for n, t in floats if not _all_finite([t]))
            raise RunError(f"the weights went non-finite ({name}) in the optimizer update "
                           f"of step {version - 1} (weight version {version}); lower "
                           "optimizer.lr or check the gradients")
        yield bucket
        if i == 0:  # crash tests (MEGATRON_GSPO_FAULT): the engine holds part of the update
            faults.maybe_kill_rank("kill_in_sync", version)


def _tensor_sync(cfg: Config) -> bool:
    """SGLang with `update_weights_from_tensor` (tensor, or auto while colocated)."""
    r = cfg.rollout
    return r.engine == "sglang" and (r.weight_sync == "tensor"
                                     or (r.weight_sync == "auto" and r.colocate))
