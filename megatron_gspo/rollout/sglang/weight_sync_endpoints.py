"""Weight sync of the SGLang engine (matches SGLang's endpoints): pause / continue generation,
`/update_weights_from_tensor` with flattened buckets (colocated), `/init_weights_update_group` +
`/update_weights_from_distributed` (NCCL broadcast from the learner, disaggregated),
`/update_weights_from_disk`, `/flush_cache`.

Tensor updates stream: one bucket is flattened, serialized, posted and dropped before the next
one is taken from the iterable, so the payload memory alive at once stays within one bucket;
`sync_stats` reports the peak. Whether a payload can be built is decided by where its tensors
are, not by the servers' version: CPU tensors travel as shared memory by file name, which
SGLang's unpickler opens without sglang in the learner's environment; CUDA tensors need SGLang's
own CUDA reduction (sglang importable here), else the sync fails before its first request with
one error.

A mixin of `SGLangEngine`: it uses the engine's `_all` (one call to every server), `_post`,
`urls`, `tp_size` and weight-version state.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from megatron_gspo.rollout.engine import Bucket, RolloutError
from megatron_gspo.rollout.sglang import versions as compat
from megatron_gspo.rollout.sglang.draft_probe import DraftSync
from megatron_gspo.rollout.weight_sync_payloads import (
    bucket_payloads,
    dtype_name,
    init_learner_update_group,
    WeightSyncError,
    payload_error,
    serialize,
)
from megatron_gspo.rollout.served_shapes import checkpoint_shapes, shape_error

STANDIN_VERSION = "standin"  # `version` in the stand-in server's /get_server_info

#: Prompt of the sync probe: after a weight sync each server generates from it and the
#: learner recomputes the log-probs of what was generated (`check_sync_probe`).
PROBE_PROMPT = (3, 5, 7, 11, 13, 17, 19, 23)
PROBE_TOKENS = 8
#: Largest |served - learner| token log-prob of a verified sync, by the served dtype
#: (fp32: SGLang's CPU engine matches a recompute within 3e-5; bf16 rounding dominates).
PROBE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.15, "float16": 0.05}


def check_sync_probe(version: int, probes: Sequence[tuple[str, list[int], list[float]]],
                     learner: Sequence[Sequence[float]], tol: float) -> float:
    """Compare each server's log-probs of its probe answer with the learner's recompute.

    Args:
        version: the weight version the sync installed (named in the error).
        probes: (server url, generated ids, served log-probs) per server.
        learner: the learner's log-probs of each probe's generated ids, same order.
        tol: largest allowed |difference| of one token's log-prob.
    Returns:
        the largest difference seen.
    Raises:
        RolloutError: a server's log-probs differ by more than `tol` (the sync did not reach
            it, e.g. parameter names it skipped silently), one line naming the sync.
    """
    worst = 0.0
    for (url, ids, served), mine in zip(probes, learner, strict=True):
        if len(mine) != len(served) or not ids:
            raise RolloutError(f"weight sync to version {version}: probe of {url} returned "
                               f"{len(served)} log-probs for {len(ids)} tokens")
        diff = max(abs(float(a) - float(b)) for a, b in zip(served, mine, strict=True))
        if diff > tol:
            raise RolloutError(
                f"weight sync to version {version} not verified: {url} serves probe log-probs "
                f"{diff:.3g} away from the learner's (tolerance {tol:g}); the server does not "
                "hold the learner's weights (names it does not know are skipped silently)")
        worst = max(worst, diff)
    return worst


class LiveBytes:
    """Bytes of the weight-sync payload tensors still alive (weak references: a payload
    counts until its last reference is gone)."""

    def __init__(self) -> None:
        self._refs: list[tuple[weakref.ref, int]] = []

    def add(self, payload: Any) -> int:
        """Register a payload; returns the live bytes including it."""
        for t in _payload_tensors(payload):
            self._refs.append((weakref.ref(t), t.numel() * t.element_size()))
        return self.now()

    def now(self) -> int:
        self._refs = [(r, n) for r, n in self._refs if r() is not None]
        return sum(n for _, n in self._refs)


def _payload_tensors(payload: Any) -> list:
    if isinstance(payload, dict):
        return [payload["flattened_tensor"]]
    return [t for _, t in payload]


class SGLangWeightSync(DraftSync):
    """Weight-update methods shared by `SGLangEngine` (see module docstring); the draft's
    side (speculative servers) is `draft_probe.DraftSync`'s."""

    urls: list[str]
    tp_size: int
    weight_sync: str
    dist_master: tuple[str, int] | None
    dist_backend: str
    _version: int
    _update_group: Any
    _open_updates: list[str]
    _has_update_sessions: dict[str, bool]
    _group_name: str
    sync_stats: dict[str, float]
    # and the engine's coroutines astart(), _post(url, path, body) and _all(path, body).

    async def pause_generation(self, mode: str = "abort") -> None:
        """Pause the servers; mode "abort" (SGLang's default) returns running requests with
        finish reason "abort", "retract" re-queues them, "in_place" keeps them."""
        await self._all("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """Let generation go on; a weight-update session a failed update left open is closed
        first (best effort: the next update could not open one)."""
        if self._open_updates:
            try:
                await self.aend_update_sessions()
            except RolloutError:
                pass
        await self._all("/continue_generation")

    async def abegin_update_sessions(self) -> None:
        """Open a weight-update session on every server that has them (SGLang 0.5.23 takes
        tensor and distributed updates only inside one; 0.5.12 answers 404, remembered per
        server: `compat.lacks_update_sessions`)."""
        known = self._has_update_sessions

        async def begin(u: str) -> str | None:
            if known.get(u) is False:
                return None
            try:
                await self._post(u, compat.UPDATE_SESSION_PATHS[0], {"selector": "all"})
            except RolloutError as e:
                if not compat.lacks_update_sessions(e):
                    raise
                known[u] = False
                return None
            known[u] = True
            return u

        self._open_updates = [u for u in await asyncio.gather(*map(begin, self.urls)) if u]

    async def aend_update_sessions(self) -> None:
        """Close the sessions `abegin_update_sessions` opened (SGLang finalizes the weights)."""
        opened, self._open_updates = self._open_updates, []
        await asyncio.gather(*(self._post(u, compat.UPDATE_SESSION_PATHS[1], {})
                               for u in opened))

    async def flush_cache(self) -> None:
        await self._all("/flush_cache")

    async def aupdate_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Update all servers by the configured `weight_sync` path (deltas when a
        `rollout.delta` sender is attached as `self.delta`: `sglang.weight_sync_delta`)."""
        delta = getattr(self, "delta", None)
        if delta is not None and delta.enabled:
            from megatron_gspo.rollout.sglang.weight_sync_delta import aupdate_delta

            await aupdate_delta(self, delta, buckets, version)
            return
        if self.weight_sync == "distributed":
            if self._update_group is None:
                assert self.dist_master is not None
                await self.aconnect_distributed(*self.dist_master, backend=self.dist_backend)
            await self.aupdate_weights_distributed(buckets, version)
        else:
            await self.aupdate_weights_from_tensor(buckets, version)

    def _reset_sync_stats(self) -> None:
        self.sync_stats = {"buckets": 0.0, "requests": 0.0, "bytes": 0.0,
                           "peak_live_bucket_bytes": 0.0, "max_bucket_bytes": 0.0}

    async def abegin_tensor_update(self) -> None:
        """Reset `sync_stats`, pause generation, open the servers' weight-update sessions."""
        self._reset_sync_stats()
        await self.pause_generation()
        await self.abegin_update_sessions()

    async def apost_tensor_update(
        self, entries: Sequence[Sequence[str]], load_format: str | None, version: int
    ) -> None:
        """One /update_weights_from_tensor per server; `entries[i]` are server i's
        `serialized_named_tensors` (one per TP rank)."""
        if len(entries) != len(self.urls):
            raise RolloutError(f"{len(entries)} entry lists for {len(self.urls)} servers")
        for url, server in zip(self.urls, entries, strict=True):  # what would end a server:
            refusal = compat.unpickler_refusal(self.server_info.get(url))  # its release's rule
            for e in set(server):
                bad = payload_error(e, refusal)
                if bad:
                    raise RolloutError(f"weight sync to version {version}: {bad}; not sent")
        body = {"load_format": load_format, "flush_cache": False, "weight_version": str(version)}
        await asyncio.gather(*(
            self._post(u, "/update_weights_from_tensor", {**body, "serialized_named_tensors":
                                                          list(e)})
            for u, e in zip(self.urls, entries, strict=True)))
        self.sync_stats["requests"] += 1

    def note_bucket(self, nbytes: int, live_bytes: int) -> None:
        """Account one bucket of `nbytes`; `live_bytes` is what its transfer held at once."""
        st = self.sync_stats
        st["buckets"] += 1
        st["bytes"] += nbytes
        st["max_bucket_bytes"] = max(st["max_bucket_bytes"], float(nbytes))
        st["peak_live_bucket_bytes"] = max(st["peak_live_bucket_bytes"], float(live_bytes))

    async def afinish_tensor_update(self, version: int) -> None:
        """Close the update sessions, flush the prefix cache and switch to `version`
        (generation continues after)."""
        await self.aend_update_sessions()
        await self.flush_cache()
        self._version = int(version)

    async def aupdate_weights_from_tensor(self, buckets: Iterable[Bucket], version: int) -> None:
        """Colocated update: every bucket through /update_weights_from_tensor (flattened, one
        request per dtype), streamed: a bucket's tensors are handed over to its payloads group
        by group, and each payload is dropped once the servers answered (the exporter keeps no
        reference to a bucket it yielded)."""
        await self.abegin_tensor_update()
        live = LiveBytes()
        try:
            for bucket in buckets:
                named = list(bucket)
                del bucket  # this loop holds the tensors through `named` only
                self.check_shapes(named, version)
                self.note_draft(named, "tensor")
                total = sum(t.numel() * t.element_size() for _, t in named)
                peak = 0
                for payload, fmt in bucket_payloads(_drain(named)):
                    peak = max(peak, live.add(payload))
                    entries = self.serialize_entries(payload, version)
                    await self.apost_tensor_update([entries] * len(self.urls), fmt, version)
                    del payload, entries  # the servers have copied the shared memory
                self.note_bucket(total, peak)
            await self.afinish_tensor_update(version)
        finally:
            await self.continue_generation()

    def serialize_entries(self, payload: Any, version: int) -> list[str]:
        """One serialized entry per TP rank of `payload`; a payload that cannot be built (CUDA
        tensors without sglang importable) is one RolloutError naming the sync."""
        try:
            return [serialize(payload) for _ in range(self.tp_size)]
        except WeightSyncError as e:
            raise RolloutError(f"weight sync to version {version}: {e}") from None

    def check_shapes(self, named: Sequence[tuple[str, Any]], version: int) -> None:
        """Refuse (one RolloutError naming the sync) a tensor whose shape differs from the
        served checkpoint's: SGLang's weight loader asserts the shape and the server dies."""
        if not hasattr(self, "_ckpt_shapes"):
            spec = getattr(self, "spec", None)
            infos = getattr(self, "server_info", {}).values()
            path = spec.model_path if spec is not None else next(
                (i.get("model_path") for i in infos if isinstance(i, dict)), None)
            self._ckpt_shapes = checkpoint_shapes(path) if path else None
        bad = shape_error(named, self._ckpt_shapes)
        if bad:
            raise RolloutError(f"weight sync to version {version}: {bad}")

    async def aprobe_servers(self, temperature: float = 1.0, prompt: Sequence[int] = PROBE_PROMPT,
                             max_new_tokens: int = PROBE_TOKENS,
                             ) -> list[tuple[str, list[int], list[float]]]:
        """(url, generated ids, served log-probs) of the probe prompt on every server. A client
        over every node's servers (`multinode.ClusterClient`, which has `down`) leaves out a
        server whose connection is refused or dropped, as its generation does: its node
        restarts it, and it is probed, at the next sync; one server at least must answer."""
        import aiohttp

        from megatron_gspo.rollout.sglang.protocol import parse_generate_output

        body = {"input_ids": list(prompt), "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature,
                                    "ignore_eos": True}}
        await self.astart()
        urls, down = list(self.urls), getattr(self, "down", None)
        outs = await asyncio.gather(*(self._post(u, "/generate", body) for u in urls),
                                    return_exceptions=down is not None)
        probes = []
        for url, out in zip(urls, outs, strict=True):
            if isinstance(out, BaseException):
                if not isinstance(out.__cause__, aiohttp.ClientConnectionError) or down is None:
                    raise out
                down.add(url)
                continue
            ids, lps, _, _ = parse_generate_output(out, f"sync probe from {url}", max_new_tokens,
                                                   getattr(self, "vocab_size", None))
            probes.append((url, ids, lps))
        if not probes:
            raise RolloutError(f"no server answered the sync probe ({len(urls)} unreachable)")
        return probes

    async def aupdate_weights_from_disk(self, model_path: str, version: int) -> None:
        """Reload weights from a HF directory on every server."""
        body = {"model_path": model_path, "weight_version": str(version)}
        self.note_draft_dir(model_path)
        await self._all("/update_weights_from_disk", body)
        self._version = int(version)

    async def aconnect_distributed(
        self, master_address: str, master_port: int, backend: str = "nccl",
        group_name: str = "weight_update_group",
    ) -> Any:
        """Form the learner (rank 0) + server-ranks group for broadcast updates. The learner
        hosts the group's store at master_address:master_port; an address this machine cannot
        listen on is refused before any server is asked (a server waiting on an unreachable
        master blocks entirely, even /health)."""
        bad = master_address_error(master_address, master_port)
        if bad:
            raise RolloutError(f"rollout.weight_sync_master: {bad}; no server was asked")
        await self.astart()
        world = 1 + self.tp_size * len(self.urls)
        calls = [
            asyncio.ensure_future(self._post(u, "/init_weights_update_group", {
                "master_address": master_address, "master_port": master_port,
                "rank_offset": 1 + i * self.tp_size, "world_size": world,
                "group_name": group_name, "backend": backend,
            })) for i, u in enumerate(self.urls)
        ]
        pg = await asyncio.to_thread(
            init_learner_update_group, master_address, master_port, world, group_name, backend
        )
        await asyncio.gather(*calls)
        self._update_group, self._group_name = pg, group_name
        return pg

    def close_update_group(self) -> None:
        """Destroy the learner's side of the weight-update group (at shutdown): torch keeps a
        group by name for the process's life, so a later engine in the same process could not
        form its own "weight_update_group" ("group name has already been created")."""
        import torch.distributed as dist

        if self._update_group is not None:
            pg, self._update_group = self._update_group, None
            dist.destroy_process_group(pg)

    async def aupdate_weights_distributed(self, buckets: Iterable[Bucket], version: int) -> None:
        """Disaggregated update: metadata over HTTP, tensors by broadcast from the learner."""
        import torch.distributed as dist

        if self._update_group is None:
            raise RolloutError("call aconnect_distributed() before a distributed weight update")
        await self.pause_generation()
        try:
            await self.abegin_update_sessions()
            await self.alink_drafts(version)  # 0.5.12's broadcast skips the draft
            for bucket in buckets:
                named = list(bucket)
                self.check_shapes(named, version)
                self.note_draft(named, "distributed")
                body = {
                    "names": [n for n, _ in named],
                    "dtypes": [dtype_name(t.dtype) for _, t in named],
                    "shapes": [list(t.shape) for _, t in named],
                    "group_name": self._group_name, "flush_cache": False,
                    "weight_version": str(version),
                }
                calls = asyncio.ensure_future(self._all("/update_weights_from_distributed", body))

                def send(named: list = named) -> None:
                    for _, t in named:
                        dist.broadcast(t.contiguous(), src=0, group=self._update_group)

                await asyncio.to_thread(send)
                await calls
            await self.aend_update_sessions()
            await self.flush_cache()
            self._version = int(version)
        finally:
            await self.continue_generation()


def master_address_error(host: str, port: int) -> str | None:
    """Why the learner cannot host the weight-update group's TCP store at host:port, or None."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"{host} does not resolve ({e})"
    fam, _, _, _, addr = infos[0]
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return (f"the learner cannot listen on {host}:{port} ({e.strerror or e}): it hosts "
                    "the weight-update group's store there, so it must be this machine's address "
                    "that the servers reach")
    return None


def _drain(named: list) -> Iterable:
    """Yield the pairs of `named`, emptying it, so the caller keeps no reference."""
    while named:
        yield named.pop(0)
