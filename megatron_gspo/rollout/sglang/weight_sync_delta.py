"""Delta weight sync to SGLang servers (`rollout.weight_sync_delta`; the encoding and the base
are `rollout.delta`'s): the same three paths as a full sync, carrying deltas.

- tensor (colocated): each bucket's delta pairs as one plain named-tensor list through
  `/update_weights_from_tensor` with `load_format = LOADER`; SGLang 0.5.12 hands them to the
  custom loader (`--custom-weight-loader gspo_delta_loader.load`, model_runner.py).
- distributed (NCCL/gloo): SGLang's broadcast path has no custom-loader hook, but it hands the
  received pairs to `model.load_weights`, which the loader wraps: one empty
  `/update_weights_from_tensor` call (a pickled `[]`, no shared memory, so it also reaches
  servers on other hosts) installs the wrapper before each full sync; the delta pairs then go
  out as an ordinary broadcast bucket (names, dtypes and shapes over HTTP).
- disk: each bucket written as a delta file to a directory the servers read, and one
  `/update_weights_from_tensor` naming the file (`/update_weights_from_disk` only runs SGLang's
  default loader on a checkpoint directory).
With `base=hash` the changed tensors go whole through SGLang's own formats (no loader).

Before a delta sync every server's `/model_info` must report the acknowledged weight version (a
restarted server reports its start version), and no release of the `weights` region may have
happened since: otherwise the sync is full.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable
from typing import Any

from megatron_gspo.rollout.engine import Bucket, RolloutError
from megatron_gspo.rollout.delta.codec import file_pairs, write_file
from megatron_gspo.rollout.delta.sender import DeltaSender
from megatron_gspo.rollout.weight_sync_payloads import bucket_payloads, dtype_name

#: The loader's module.function as servers import it (`loader_dir` puts it on their path).
LOADER = "gspo_delta_loader.load"


def loader_dir(root: str | None = None) -> str:
    """A folder holding only gspo_delta_loader.py (copied from this package), for a server's
    PYTHONPATH; `root` defaults to a fresh temporary folder."""
    import shutil
    import tempfile

    from megatron_gspo.rollout.delta import gspo_delta_loader

    d = root or tempfile.mkdtemp(prefix="gspo-delta-loader-")
    os.makedirs(d, exist_ok=True)
    shutil.copyfile(gspo_delta_loader.__file__, os.path.join(d, "gspo_delta_loader.py"))
    return d


def launch_extras(env: dict[str, str], mode: str, base: str, folder: str | None = None
                  ) -> tuple[tuple[str, ...], dict[str, str]]:
    """(extra server arguments, environment) of a launched server: with deltas on a base copy,
    `--custom-weight-loader` and the loader's folder (`loader_dir(folder)`) on PYTHONPATH;
    else none and `env` unchanged."""
    if mode == "off" or base != "copy":
        return (), env
    old = env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")
    return (("--custom-weight-loader", LOADER),
            {**env, "PYTHONPATH": loader_dir(folder) + (os.pathsep + old if old else "")})


async def acheck_base(engine: Any, sender: DeltaSender) -> None:
    """Invalidate the base unless every server serves the acknowledged version and the
    weights region was not released since."""
    if sender.acked_version is None:
        return
    releases = getattr(engine, "weights_releases", 0)
    if releases != sender.releases_seen:
        sender.invalidate("the weights region was released since the last sync")
        return
    infos = await engine._all("/model_info", get=True)
    for url, info in zip(engine.urls, infos, strict=True):
        served = (info or {}).get("weight_version") if isinstance(info, dict) else None
        if served != str(sender.acked_version):
            sender.invalidate(f"{url} serves weight version {served!r}, not the acknowledged "
                              f"{sender.acked_version} (restarted?)")
            return


def tensor_requests(pairs: list, copy: bool) -> list[tuple[Any, str | None]]:
    """(payload, load_format) of each `/update_weights_from_tensor` of one encoded bucket: the
    delta bucket for the loader (base copy), or SGLang's flattened buckets (base hash)."""
    return [(pairs, LOADER)] if copy else list(bucket_payloads(pairs))


def off_host_error(pairs: list) -> str | None:
    """Why rank 0 alone must not serialize `pairs` for every server, or None: tensors on a GPU
    would reach each server as CUDA IPC handles to rank 0's GPU (a context on it that no plan
    counts, SGLang managers/tp_worker.py); `multinode.colocated.stream_buckets` places them."""
    t = next((t for _, t in pairs if t.device.type != "cpu"), None)
    if t is None:
        return None
    return (f"a delta bucket on {t.device} cannot go to every server from one process; "
            "colocated servers get it through the colocated tensor sync, servers attached by "
            "URL through rollout.weight_sync=distributed")


async def abegin_delta(engine: Any, sender: DeltaSender, version: int,
                       dist_path: bool = False) -> None:
    """Start a delta sync: check the base, choose full or delta, pause the servers, open their
    update sessions (and install the loader's wrapper before a full broadcast sync). Once the
    servers are paused a failure ends the sync (`aend_delta`) before it is raised."""
    await engine.astart()
    await acheck_base(engine, sender)
    st = sender.begin(version)
    if dist_path and engine._update_group is None:
        await engine.aconnect_distributed(*engine.dist_master, backend=engine.dist_backend)
    engine._reset_sync_stats()
    await engine.pause_generation()
    try:
        await engine.abegin_update_sessions()
        if dist_path and sender.base_kind == "copy" and not st.delta:  # (re)install wrapper
            await _post_tensor(engine, [], LOADER, version)
        if dist_path:  # then the draft link (under the wrapper: the draft gets decoded tensors)
            await engine.alink_drafts(version)
    except BaseException:
        await aend_delta(engine, sender, version, False)
        raise


async def aend_delta(engine: Any, sender: DeltaSender, version: int, ok: bool) -> None:
    """End a delta sync: on success close the sessions, flush the cache and take `version`;
    the sender keeps its base only when `ok`; generation goes on either way."""
    try:
        if ok:
            await engine.aend_update_sessions()
            await engine.flush_cache()
            engine._version = int(version)
    except BaseException:
        ok = False
        raise
    finally:
        sender.releases_seen = getattr(engine, "weights_releases", 0)
        sender.finish(ok)
        await engine.continue_generation()


async def aupdate_delta(engine: Any, sender: DeltaSender, buckets: Iterable[Bucket],
                        version: int, disk_dir: str | None = None) -> dict[str, float]:
    """One sync through `sender` by the engine's `weight_sync` path (or files in `disk_dir`),
    posted by this process alone: CPU tensors on the tensor path (`off_host_error`).

    Returns:
        the sync's `delta_*` numbers (also kept in `sender.stats`).
    """
    copy = sender.base_kind == "copy"
    dist_path = engine.weight_sync == "distributed" and disk_dir is None
    await abegin_delta(engine, sender, version, dist_path)
    st, ok = sender.stats, False
    try:
        for i, bucket in enumerate(buckets):
            named = list(bucket)
            del bucket
            engine.check_shapes(named, version)
            engine.note_draft(named, "delta " + ("disk" if disk_dir is not None else
                                                 "distributed" if dist_path else "tensor"))
            pairs = sender.encode(named)
            del named
            t0 = time.perf_counter()
            if disk_dir is not None:
                path = os.path.join(disk_dir, f"delta-v{version}-b{i}.pt")
                write_file(path, pairs)
                await _post_tensor(engine, file_pairs(path), LOADER, version)
            elif dist_path and pairs:
                await _broadcast(engine, pairs, version)
            elif not dist_path:
                bad = off_host_error(pairs)
                if bad:
                    raise RolloutError(f"weight sync to version {version}: {bad}")
                for payload, fmt in tensor_requests(pairs, copy):
                    await _post_tensor(engine, payload, fmt, version)
            st.apply_s += time.perf_counter() - t0
            engine.note_bucket(sum(t.numel() * t.element_size() for _, t in pairs), 0)
            del pairs
            sender.commit()
        ok = True
    finally:
        await aend_delta(engine, sender, version, ok)
    return st.metrics()


async def _post_tensor(engine: Any, payload: Any, load_format: str | None, version: int) -> None:
    entries = engine.serialize_entries(payload, version)
    await engine.apost_tensor_update([entries] * len(engine.urls), load_format, version)


async def _broadcast(engine: Any, pairs: list, version: int) -> None:
    """One bucket of pairs through `/update_weights_from_distributed` and the broadcast."""
    import torch.distributed as dist

    body = {"names": [n for n, _ in pairs], "dtypes": [dtype_name(t.dtype) for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs], "group_name": engine._group_name,
            "flush_cache": False, "weight_version": str(version)}
    calls = asyncio.ensure_future(engine._all("/update_weights_from_distributed", body))

    dev = "cuda" if engine.dist_backend == "nccl" else "cpu"  # the manifest is built on CPU

    def send() -> None:
        for _, t in pairs:
            dist.broadcast(t.to(dev).contiguous(), src=0, group=engine._update_group)

    await asyncio.to_thread(send)
    await calls
