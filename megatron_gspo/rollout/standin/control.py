"""The information and control side of the stand-in SGLang server (`standin.server.StandinServer`
mixes it in next to `generate.GenerationEndpoints`): `/health`, `/health_generate`,
`/model_info`, `/server_info`, `/release_memory_occupation` (refused while busy; ends a CPU
server acting as SGLang 0.5.23),
`/pause_generation`, `/continue_generation`, `/abort_request` and `/standin/faults`.
Upstream files are named where each one's behaviour is copied.
"""

from __future__ import annotations

import asyncio
import uuid

from aiohttp import web

from megatron_gspo.rollout.engine import SamplingParams
from megatron_gspo.rollout.standin.generate import MISSING_BODY, _bad


class ControlEndpoints:
    """Health, information and control endpoints (state lives in `GenerationEndpoints`)."""

    # ------------------------------------------------------------ information
    async def health(self, request: web.Request) -> web.Response:
        """entrypoints/http_server.py `health_generate` (serves /health and /health_generate)."""
        if self.faults.crash:
            return await self._crash(request)  # type: ignore[return-value]
        if request.path == "/health" and not self.health_generation:
            return web.Response(status=200)
        if self.released:  # a generation on released (unmapped) memory gets no answer
            return web.Response(status=503)
        self.stats["health_generations"] += 1
        if self.faults.health_race > 0:  # queued, not run (see module docstring)
            self.faults.health_race -= 1
            waiter: asyncio.Future = asyncio.get_running_loop().create_future()
            self._health_waiting.append(waiter)
            try:
                await asyncio.wait_for(waiter, self.health_timeout_s)
            except asyncio.TimeoutError:
                return web.Response(status=503)
            return web.Response(status=200)
        self.in_flight += 1
        try:
            rows = [([0], SamplingParams(max_new_tokens=1, temperature=0.0))]
            await asyncio.wait_for(self._run_rows(rows, f"HEALTH_CHECK_{uuid.uuid4().hex}"),
                                   self.health_timeout_s)
        except Exception:
            return web.Response(status=503)
        finally:
            self.in_flight -= 1
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": self.model_path, "is_generation": True,
             "weight_version": self.weight_version,
             "model_type": getattr(self.engine.model.config, "model_type", None)}
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": self.model_path, "tp_size": self.tp_size, "dp_size": self.dp_size,
             "context_length": self.context_length_arg,
             # acting as 0.5.23: its release, so that the client picks that release's rules
             "version": "0.5.23+standin" if self.weight_update_sessions else "standin",
             "weight_version": self.weight_version, "device": self.device,
             "served_model_name": self.served_model_name,  # --served-model-name, verbatim
             # SGLang's /server_info lists every ServerArgs field
             "enable_return_routed_experts": getattr(self, "enable_return_routed_experts", False),
             "custom_weight_loader": list(getattr(self, "custom_weight_loaders", ())),
             **{f"speculative_{k}": v for k, v in (getattr(self, "speculative", None) or {
                 "algorithm": None}).items()}}
        )

    # ------------------------------------------------------------ control
    async def release_if_idle(self, request: web.Request) -> web.StreamResponse:
        """/release_memory_occupation; while requests are in flight the server ends, as
        upstream, where the scheduler asserts it is idle
        (managers/scheduler_update_weights_mixin.py) and the failed assertion ends it. A CPU
        server acting as 0.5.23 (`weight_update_sessions`) always ends: its release's closing
        `torch.get_device_module().synchronize()` is torch.cuda under torch 2.14.1
        (managers/scheduler_components/weight_updater.py; `sglang.versions`)."""
        if self.in_flight or self._queue:
            return await self.die(request, "AssertionError: release_memory_occupation should "
                                  f"be called only when server is idle ({self.in_flight} "
                                  "requests in flight)")
        if self.device == "cpu" and self.weight_update_sessions:
            return await self.die(request, "RuntimeError: Found no NVIDIA driver on your system "
                                  "(managers/scheduler_components/weight_updater.py:379)")
        return await self.release(request)  # type: ignore[attr-defined]

    async def pause(self, request: web.Request) -> web.Response:
        text = await request.text()
        mode = (await request.json()).get("mode", "abort") if text.strip() else "abort"
        if mode == "abort":  # requests not yet started come back with finish reason abort
            for rows, fut, _ in self._queue:
                if not fut.done():
                    fut.set_result([([], [], "abort_waiting")] * len(rows))
            self._queue = []
        self._paused = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(self, request: web.Request) -> web.Response:
        if not (await request.text()).strip():  # FastAPI's body validation, as upstream
            return web.json_response(MISSING_BODY, status=400)
        self._paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        b = await request.json()
        self.aborts.append("*" if b.get("abort_all") else str(b.get("rid")))
        keep = []
        for rows, fut, rid in self._queue:  # only requests not yet started can be aborted
            if b.get("abort_all") or rid == b.get("rid"):
                if not fut.done():
                    fut.set_result([([], [], "abort_waiting")] * len(rows))
            else:
                keep.append((rows, fut, rid))
        self._queue = keep
        return web.Response(status=200)

    async def set_faults(self, request: web.Request) -> web.Response:
        b = await request.json()
        for k, v in b.items():
            if not hasattr(self.faults, k):
                return _bad(f"unknown fault {k!r}")
            setattr(self.faults, k, type(getattr(self.faults, k))(v))
        return web.json_response({"success": True})
