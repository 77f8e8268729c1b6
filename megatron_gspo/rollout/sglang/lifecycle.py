"""Server lifecycle of the SGLang engine (mixed into `sglang.SGLangEngine`): launch servers and
router, wait for health, read and check every server's `GET /server_info` (tp_size equal to
the configuration, dp_size 1, the context length), answer `ahealth`, stop what was launched.
A launched server must answer with this launch's token (`LaunchSpec.run_token`, its
`--served-model-name`) before anything but /health_generate is sent to it: a port another job
took between the pick and the bind answers with that job's server, refused in one line naming
whose it is (`ports.identity_error`). Launched servers' ports stay held until they stop.

The context length is the server's `context_length` (its --context-length), else the model
config at its `model_path` when that is a local directory (SGLang's derivation, see
`sglang_protocol.context_length_of`), else the value the engine was given.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from megatron_gspo.rollout.engine import RolloutError
from megatron_gspo.rollout.sglang import versions as compat
from megatron_gspo.rollout.sglang.launch import (
    LaunchSpec,
    ServerProcess,
    pick_dist_port,
    pick_ports,
    redact_argv,
    router_argv,
    server_argv,
    server_env,
)
from megatron_gspo.rollout.sglang.ports import PortHold, identity_error
from megatron_gspo.rollout.sglang.protocol import context_length_of, decode_json, http_error

log = logging.getLogger("megatron_gspo.rollout.sglang.client")

#: Transient transport failures of one HTTP call.
RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError,
             aiohttp.ClientPayloadError, asyncio.TimeoutError)


def _local_context_length(model_path: Any) -> int | None:
    """Context length from `model_path`/config.json when that is readable here, else None."""
    if not isinstance(model_path, str) or not os.path.isfile(
            os.path.join(model_path, "config.json")):
        return None
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            return context_length_of(json.load(f))
    except (OSError, ValueError):
        return None


class SGLangServers:
    """Launch/attach/check/stop half of `SGLangEngine` (uses its urls, spec, procs, router
    settings, session and `_closed`/`_started` state)."""

    urls: list[str]
    spec: LaunchSpec | None
    procs: list[ServerProcess]
    router_proc: ServerProcess | None
    router_url: str | None
    launch_router: bool
    router_port: int
    router_policy: str
    startup_timeout_s: float
    tp_size: int
    context_length: int | None
    server_info: dict[str, dict]
    _api_key: str | None
    _closed: bool
    _started: bool
    _inflight: dict[str, int]
    _port_hold: PortHold | None = None
    _sess: Any  # the engine's session factory

    async def astart(self) -> None:
        """Launch (if configured), wait until every server answers /health_generate, then read
        and check every server's /server_info."""
        if self._closed:
            raise RolloutError("SGLang engine is shut down")
        if self._started:
            return
        try:
            if self.spec is not None:
                await self._launch()
            if self.launch_router and self.router_url is None:
                await self._start_router()
            infos = await asyncio.gather(*(self._read_server_info(u) for u in self.urls))
            self._check_server_info(infos)
            self._started = True
        except BaseException:
            await self._stop_processes()
            raise
        for u in self.urls:
            self._inflight.setdefault(u, 0)

    async def _launch(self) -> None:
        spec = self.spec
        assert spec is not None
        hold = self.port_hold()
        ports = pick_ports(spec.host, spec.base_port, spec.num_servers, hold=hold)
        taken = list(ports)
        for i, port in enumerate(ports):
            logp = os.path.join(spec.log_dir, f"sglang_server_{i}.log") if spec.log_dir else None
            if spec.log_dir:
                os.makedirs(spec.log_dir, exist_ok=True)
            taken.append(pick_dist_port(taken, hold=hold))
            argv = server_argv(spec, i, port, taken[-1])
            log.info("launching rollout server %d: %s", i, " ".join(redact_argv(argv)))
            name = f"sglang server {i} (port {port})"
            self.procs.append(ServerProcess(argv, name, server_env(spec), logp))
            self.urls.append(f"http://{spec.host}:{port}")
        waits = [self._wait_healthy(u, p) for u, p in zip(self.urls, self.procs, strict=True)]
        await asyncio.gather(*waits)

    async def _start_router(self) -> None:
        host = self.spec.host if self.spec else "127.0.0.1"
        port = self.router_port or pick_ports(host, 0, 1)[0]
        argv = router_argv(self.urls, host, port, self.router_policy, api_key=self._api_key)
        log.info("launching sglang router: %s", " ".join(redact_argv(argv)))
        self.router_proc = ServerProcess(argv, f"sglang router (port {port})")
        self.router_url = f"http://{host}:{port}"
        await self._wait_healthy(self.router_url, self.router_proc, path="/health")

    async def _read_server_info(self, url: str) -> dict:
        """GET /server_info (the pre-0.5 name /get_server_info when that is 404)."""
        for path in ("/server_info", "/get_server_info"):
            try:
                async with self._sess().get(url + path,
                                            timeout=aiohttp.ClientTimeout(total=60)) as r:
                    text = await r.text()
                    if r.status == 404 and path == "/server_info":
                        continue
                    if r.status != 200:
                        raise RolloutError(http_error(url + path, r.status, text))
            except (*RETRYABLE, aiohttp.ClientError) as e:
                raise RolloutError(f"{url}{path} failed: {type(e).__name__}: {e}") from e
            try:
                info = decode_json(text)
            except ValueError as e:
                raise RolloutError(f"{url}{path}: {e}") from None
            if not isinstance(info, dict):
                raise RolloutError(f"{url}{path}: expected a JSON object, got {text[:100]!r}")
            return info
        raise AssertionError("unreachable")

    def port_hold(self) -> PortHold:
        """The holds on this engine's launched servers' ports (released when they stop)."""
        if self._port_hold is None:
            self._port_hold = PortHold()
        return self._port_hold

    def _check_server_info(self, infos: Sequence[dict]) -> None:
        """Refuse a launched server that is not this launch's (its token), tp/dp sizes that
        differ from the configuration; take the context length."""
        contexts = []
        for url, info in zip(self.urls, infos, strict=True):
            wrong = identity_error(url, info, self.spec.run_token) if self.spec else None
            if wrong:
                raise RolloutError(wrong)
            self.server_info[url] = info
            note = compat.version_warning(info)
            if note:
                log.warning("%s: %s", url, note)
            tp, dp = info.get("tp_size", 1), info.get("dp_size", 1)
            if tp != self.tp_size:
                raise RolloutError(
                    f"{url} reports tp_size={tp} but rollout.tp_size={self.tp_size}: set "
                    "rollout.tp_size to the servers' tensor-parallel size")
            if dp != 1:
                raise RolloutError(
                    f"{url} reports dp_size={dp}: servers with data parallelism inside are not "
                    "supported; start one server per replica and list each in "
                    "rollout.server_urls")
            if getattr(self, "return_routing", False) and \
                    info.get("enable_return_routed_experts") is False:
                raise RolloutError(
                    f"{url} runs without --enable-return-routed-experts, but the routed experts "
                    "are asked for (moe.engine_routing / moe.routing_replay r3)")
            ctx = info.get("context_length")
            if not isinstance(ctx, int) or isinstance(ctx, bool):
                ctx = _local_context_length(info.get("model_path"))
            if ctx is not None:
                contexts.append(ctx)
        if contexts:
            self.context_length = min(contexts)

    async def _wait_healthy(
        self, url: str, proc: ServerProcess | None, path: str = "/health_generate"
    ) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if proc is not None and not proc.alive():
                raise RolloutError(f"{proc.describe()} before becoming healthy")
            try:
                tmo = aiohttp.ClientTimeout(total=30)
                async with self._sess().get(url + path, timeout=tmo) as r:
                    if r.status == 200:
                        return
            except (*RETRYABLE, aiohttp.ClientError):
                pass
            if time.monotonic() > deadline:
                raise RolloutError(f"{url} not healthy after {self.startup_timeout_s:.0f} s")
            await asyncio.sleep(0.5)

    def _dead_server(self) -> ServerProcess | None:
        return next((p for p in [*self.procs, self.router_proc] if p and not p.alive()), None)

    async def _exited_server(self, grace_s: float = 5.0):
        """A launched server that is ending, once it has exited (its listening socket closes
        when the process starts to exit; the exit code comes once its memory is unmapped,
        which takes a moment for a large process on a busy machine); None when every launched
        process stays alive for `grace_s` seconds, or none was launched."""
        procs = [p for p in [*self.procs, self.router_proc] if p]
        deadline = time.monotonic() + (grace_s if procs else 0)
        while True:
            dead = self._dead_server()
            if dead is not None or time.monotonic() >= deadline:
                return dead
            await asyncio.sleep(0.05)

    async def ahealth(self) -> bool:
        """Every server answers `/health_generate` (`/model_info` while memory is released);
        why one is not healthy is logged. A failed health generation is asked once more:
        SGLang 0.5.12's scheduler only queues a health request that arrives in the loop
        iteration right after a batch and answers it at the end of the next batch
        (managers/scheduler.py `process_input_requests`, `maybe_send_health_check_signal`), so
        with no batch following a well server answers 503 after 20 s (seen on 1 of 30 checks
        right after a generation on a loaded 2-core machine)."""
        dead = self._dead_server()
        if dead is not None:
            log.warning("SGLang server not healthy: %s", dead.describe())
            return False
        # While memory is released a health generation would run on unmapped memory (and keep
        # the server busy): only ask for an answer that does not generate.
        path = "/model_info" if self.memory_released else "/health_generate"
        try:
            await self.astart()
        except RolloutError as e:
            log.warning("SGLang servers not healthy: %s", e)
            return False

        async def one(url: str, attempt: int = 1) -> bool:
            try:
                await self._post(url, path, get=True, timeout=30.0)
                return True
            except RolloutError as e:
                if attempt == 2 or path != "/health_generate":
                    log.warning("SGLang server not healthy: %s", e)
                    return False
                log.info("%s; asked once more (a health check that arrives as a batch "
                         "finishes is answered only by the next batch)", e)
                return await one(url, 2)

        return all(await asyncio.gather(*(one(u) for u in self.urls)))

    async def _stop_processes(self) -> None:
        procs = [p for p in [self.router_proc, *self.procs] if p is not None]
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in procs))
        if self._port_hold is not None and not any(p.alive() for p in procs):
            self._port_hold.release()

