"""Weight sync of the SGLang engine (matches SGLang's endpoints): pause / continue generation,
`/update_weights_from_tensor` with flattened buckets (colocated), `/init_weights_update_group` +
`/update_weights_from_distributed` (NCCL broadcast from the learner, disaggregated),
`/update_weights_from_disk`, `/flush_cache`.

A mixin of `SGLangEngine`: it uses the engine's `_all` (one call to every server), `_post`,
`urls`, `tp_size` and weight-version state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from megatron_gspo.rollout.base import Bucket, RolloutError
from megatron_gspo.rollout.weight_sync import (
    dtype_name,
    init_learner_update_group,
    tensor_update_payloads,
)


class SGLangWeightSync:
    """Weight-update methods shared by `SGLangEngine` (see module docstring)."""

    urls: list[str]
    tp_size: int
    weight_sync: str
    dist_master: tuple[str, int] | None
    dist_backend: str
    _version: int
    _update_group: Any
    _group_name: str
    # and the engine's coroutines astart(), _post(url, path, body) and _all(path, body).

    async def pause_generation(self, mode: str = "abort") -> None:
        """Pause the servers; mode "abort" (SGLang's default) returns running requests with
        finish reason "abort", "retract" re-queues them, "in_place" keeps them."""
        await self._all("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._all("/continue_generation")

    async def flush_cache(self) -> None:
        await self._all("/flush_cache")

    async def aupdate_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Update all servers by the configured `weight_sync` path."""
        if self.weight_sync == "distributed":
            if self._update_group is None:
                assert self.dist_master is not None
                await self.aconnect_distributed(*self.dist_master, backend=self.dist_backend)
            await self.aupdate_weights_distributed(buckets, version)
        else:
            await self.aupdate_weights_from_tensor(buckets, version)

    async def aupdate_weights_from_tensor(self, buckets: Iterable[Bucket], version: int) -> None:
        """Colocated update: every bucket through /update_weights_from_tensor (flattened)."""
        await self.pause_generation()
        try:
            for bucket in buckets:
                bodies, keep = tensor_update_payloads(bucket, self.tp_size, flattened=True)
                for body in bodies:
                    body.update(flush_cache=False, weight_version=str(version))
                    await self._all("/update_weights_from_tensor", body)
                del keep  # the servers have copied the shared tensors
            await self.flush_cache()
            self._version = int(version)
        finally:
            await self.continue_generation()

    async def aupdate_weights_from_disk(self, model_path: str, version: int) -> None:
        """Reload weights from a HF directory on every server."""
        body = {"model_path": model_path, "weight_version": str(version)}
        await self._all("/update_weights_from_disk", body)
        self._version = int(version)

    async def aconnect_distributed(
        self, master_address: str, master_port: int, backend: str = "nccl",
        group_name: str = "weight_update_group",
    ) -> Any:
        """Form the learner (rank 0) + server-ranks group for broadcast updates."""
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

    async def aupdate_weights_distributed(self, buckets: Iterable[Bucket], version: int) -> None:
        """Disaggregated update: metadata over HTTP, tensors by broadcast from the learner."""
        import torch.distributed as dist

        if self._update_group is None:
            raise RolloutError("call aconnect_distributed() before a distributed weight update")
        await self.pause_generation()
        try:
            for bucket in buckets:
                named = list(bucket)
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
            await self.flush_cache()
            self._version = int(version)
        finally:
            await self.continue_generation()
