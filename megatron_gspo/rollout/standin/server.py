"""A stand-in SGLang server: the native HTTP endpoints the rollout client uses, with the same
JSON shapes (matches SGLang's http_server.py / io_struct.py), backed by the embedded engine.

It lets the SGLang client be exercised over real HTTP with a real model on CPU. Generation,
health, information endpoints, the API key and the switchable faults for reliability tests
live in `standin_generate` (mixed in); the port rule at start is SGLang's
(`sglang_protocol.grpc_port_error`).

Weights and memory, as strict as SGLang 0.5.12: `/update_weights_from_tensor` decodes every TP
rank's entry with SGLang's unpickler allow-list and the byte-layout flattened bucket
(`weight_sync.py`); `/release_memory_occupation` / `/resume_memory_occupation` honour the tags
`kv_cache`, `weights`, `cuda_graph` (none = all; resuming a region that is not released is
refused); generation is refused while any region is released, a weight update while `weights`
is; weights released without `--enable-weights-cpu-backup` come back zeroed (SGLang's re-mapped
memory does not hold them), so answers are garbage until the weights are pushed again.

Concurrent /generate calls are micro-batched into one embedded-engine batch. Run as a process
with SGLang's launch flags: `python -m megatron_gspo.rollout.standin.server --model-path DIR
--port P [--host H] [--tp-size N] ...` (unknown SGLang flags are accepted and ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from typing import Any

from aiohttp import web

from megatron_gspo.rollout.base import MEMORY_TAGS, SamplingParams
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.sglang.protocol import grpc_port_error, served_dtype
from megatron_gspo.rollout.standin.generate import (
    Faults,
    GenerationEndpoints,
    api_key_middleware,
    json_not_found,
)
from megatron_gspo.rollout.weight_sync import decode_tensor_update, init_learner_update_group


_BATCHER: web.AppKey[asyncio.Task] = web.AppKey("batcher", asyncio.Task)


class StandinServer(GenerationEndpoints):
    """aiohttp app serving an `EmbeddedEngine` under SGLang's endpoint names.

    Args:
        engine: the backing engine.
        host, port: where to listen (port 0 = a free port, see `.port` after start).
        tp_size: reported tensor-parallel size (number of payload entries expected).
        model_path: reported model path.
        exit_on_crash: on the `crash` fault, end the process (subprocess mode).
        weights_cpu_backup: `--enable-weights-cpu-backup`: weights survive a release of the
            `weights` region (else they are lost, see `release`).
        dp_size: reported data-parallel size.
        context_length: `--context-length` (None: the model config's, as SGLang derives it).
        api_key: `--api-key`: every request but /health* needs it as a Bearer token.
        health_generation: /health runs a one-token generation (None: from the environment
            variable SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, default on).
        enable_return_routed_experts: `--enable-return-routed-experts` (MoE models): requests
            with `return_routed_experts` get `meta_info.routed_experts`.
    """

    def __init__(
        self, engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0, tp_size: int = 1,
        model_path: str = "", exit_on_crash: bool = False, weights_cpu_backup: bool = False,
        dp_size: int = 1, context_length: int | None = None, api_key: str | None = None,
        health_generation: bool | None = None, enable_return_routed_experts: bool = False,
    ) -> None:
        self.engine, self.host, self.port, self.tp_size = engine, host, port, tp_size
        self.model_path, self.exit_on_crash = model_path, exit_on_crash
        self.faults = Faults()
        self.weight_version = "default"
        self.stats = {"generate_calls": 0, "samples": 0, "weight_updates": 0, "flushes": 0}
        self.released = False  # some memory region is released (generation refused)
        self.released_tags: set[str] = set()
        self.weights_cpu_backup = weights_cpu_backup
        self.lost_weights: set[str] = set()  # parameters not re-pushed since their loss
        self.memory_log: list[str] = []  # "release all", "resume weights", ... as received
        self._paused = False
        self._queue: list[tuple[list[tuple[list[int], SamplingParams]], asyncio.Future, str]] = []
        self._wake: asyncio.Event | None = None
        self._groups: dict[str, Any] = {}
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._api_key = api_key
        self.enable_return_routed_experts = enable_return_routed_experts
        self._init_generation(dp_size, context_length, health_generation)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------ app setup
    def app(self) -> web.Application:
        mw = [json_not_found] + ([api_key_middleware(self._api_key)] if self._api_key else [])
        app = web.Application(client_max_size=1 << 30, middlewares=mw)
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):  # 0.5.12: /get_weight_version is 404
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_route("*", "/generate", self.generate)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_route("*", "/release_memory_occupation", self.release_if_idle)
        r.add_route("*", "/resume_memory_occupation", self.resume)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.cont)
        r.add_post("/abort_request", self.abort)
        r.add_post("/standin/faults", self.set_faults)
        r.add_get("/standin/weights_digest", self.weights_digest)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._wake = asyncio.Event()
        app[_BATCHER] = asyncio.get_running_loop().create_task(self._batcher())

    async def _on_cleanup(self, app: web.Application) -> None:
        app[_BATCHER].cancel()
        await asyncio.gather(app[_BATCHER], return_exceptions=True)

    async def start(self) -> None:
        """Start listening on the current event loop."""
        # SGLang's uvicorn closes idle keep-alive connections after 5 s (SGLANG_TIMEOUT_KEEP_ALIVE)
        self._runner = web.AppRunner(self.app(), access_log=None, keepalive_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._stopped.set()

    def start_in_thread(self) -> StandinServer:
        """Serve from a daemon thread with its own event loop; returns once listening."""
        ready = threading.Event()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self.start())
            ready.set()
            self._loop.run_until_complete(self._wait_stopped())
            self._loop.close()

        self._thread = threading.Thread(target=main, name=f"standin-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(60):
            raise RuntimeError("stand-in server did not start within 60 s")
        return self

    async def _wait_stopped(self) -> None:
        while not self._stopped.is_set():
            await asyncio.sleep(0.02)
        await self.stop()

    def stop_thread(self) -> None:
        """Stop a server started with `start_in_thread`."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.stats["flushes"] += 1
        return web.Response(text=FLUSHED)

    async def _load(self, named: list, version: Any) -> None:
        if "weights" in self.released_tags:  # SGLang would write into unmapped GPU memory
            raise RuntimeError("the weights region is released; resume 'weights' first")
        await asyncio.to_thread(self.engine.load_buckets, [named], self.engine.weight_version)
        self.lost_weights.difference_update(n for n, _ in named)
        self.stats["weight_updates"] += 1
        if version is not None:
            self.weight_version = str(version)

    async def update_from_tensor(self, request: web.Request) -> web.StreamResponse:
        """As SGLang 0.5.12: an entry that does not decode (bad base64, a class outside the
        unpickler's allow-list: utils/common.py SafeUnpickler) or a tensor of the wrong shape
        (model_loader/weight_utils.py default_weight_loader asserts the shape) raises in the
        scheduler, which ends the server; an unknown parameter name is skipped (the model's
        load_weights ignores it) and the update answers success."""
        body = await request.json()
        try:  # every TP rank deserializes its own entry (SGLang tp_worker.py)
            ranks = [decode_tensor_update(body, tp_rank=k) for k in range(self.tp_size)]
            for k, other in enumerate(ranks[1:], 1):
                if [n for n, _ in other] != [n for n, _ in ranks[0]] or not all(
                        a.equal(b) for (_, a), (_, b) in zip(ranks[0], other, strict=True)):
                    raise ValueError(f"TP rank {k}'s entry holds other tensors than rank 0's")
        except Exception as e:
            return await self.die(request, f"/update_weights_from_tensor: {e}")
        shapes = {n: self.engine.param_shape(n) for n, _ in ranks[0]}
        named = [(n, t) for n, t in ranks[0] if shapes[n] is not None]
        wrong = next(((n, t) for n, t in named if tuple(t.shape) != shapes[n]), None)
        if wrong is not None:
            return await self.die(request, f"AssertionError: {wrong[0]} has shape "
                                  f"{tuple(wrong[1].shape)}, the model {shapes[wrong[0]]}")
        try:
            await self._load(named, body.get("weight_version"))
        except Exception as e:
            return _fail(f"Failed to update weights from tensor: {e}")
        return _ok(_versioned(TENSOR_UPDATE_OK, body))

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        path = body.get("model_path", "")
        try:
            from safetensors.torch import load_file

            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {path}")
            named = [kv for f in files for kv in load_file(os.path.join(path, f)).items()]
            await self._load(named, body.get("weight_version"))
        except Exception as e:
            return web.json_response(
                {"success": False, "message": f"Failed to update weights: {e}",
                 "num_paused_requests": 0}, status=400)
        self.model_path = path
        return web.json_response(
            {"success": True, "message": _versioned("Succeeded to update model weights.", body),
             "num_paused_requests": 0})

    async def init_group(self, request: web.Request) -> web.Response:
        """The rendezvous blocks the whole server until it completes, as upstream (the
        scheduler's event loop waits in model_runner.py init_weights_update_group): with an
        unreachable master address even /health gets no answer."""
        b = await request.json()
        try:
            name = b.get("group_name", "weight_update_group")
            pg = init_learner_update_group(  # on the event loop: blocks every endpoint
                b["master_address"], int(b["master_port"]), int(b["world_size"]), name,
                b.get("backend", "nccl"), int(b["rank_offset"]),
                timeout_s=float(os.environ.get("STANDIN_GROUP_TIMEOUT_S", "600")))
            self._groups[name] = pg
        except Exception as e:
            return _fail(f"Failed to init process group: {e}")
        return _ok("Succeeded to initialize custom process group.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        import torch
        import torch.distributed as dist

        b = await request.json()
        name = b.get("group_name", "weight_update_group")
        if name not in self._groups:
            return _fail(f"Group {name} not in {list(self._groups)}")

        def recv() -> list:
            out = []
            for n, dt, shape in zip(b["names"], b["dtypes"], b["shapes"], strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dt))
                dist.broadcast(t, src=0, group=self._groups[name])
                out.append((n, t))
            return out

        try:
            named = await asyncio.to_thread(recv)
            await self._load(named, b.get("weight_version"))
        except Exception as e:
            return _fail(f"Failed to update parameter online: {e}")
        return _ok(_versioned("Succeeded to update parameter online.", b))

    async def destroy_group(self, request: web.Request) -> web.Response:
        import torch.distributed as dist

        name = (await request.json()).get("group_name", "weight_update_group")
        pg = self._groups.pop(name, None)
        if pg is None:
            return _fail(f"Group {name} not found")
        dist.destroy_process_group(pg)
        return _ok("Succeeded to destroy custom process group.")

    async def weights_digest(self, request: web.Request) -> web.Response:
        """Stand-in only (SGLang has no such endpoint): `weights_digest` of the served
        parameters, the weight version and the counters, for tests comparing them with the
        learner's."""
        named = list(self.engine.model.named_parameters())
        return web.json_response({"digest": await asyncio.to_thread(weights_digest, named),
                                  "weight_version": self.weight_version, "stats": self.stats})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        b = await request.json()
        self.weight_version = str(b.get("new_version", ""))
        return web.json_response(
            {"success": True, "message": "ok", "new_version": self.weight_version}
        )

    async def release(self, request: web.Request) -> web.Response:
        tags = await _memory_tags(request)
        if isinstance(tags, web.Response):
            return tags
        self.released_tags |= set(tags)
        self.released = True
        self.memory_log.append("release " + ",".join(tags))
        if "weights" in tags:
            await self.engine.arelease_memory()
        return web.json_response(None)

    async def resume(self, request: web.Request) -> web.Response:
        tags = await _memory_tags(request)
        if isinstance(tags, web.Response):
            return tags
        missing = [t for t in tags if t not in self.released_tags]
        if missing:  # SGLang: the KeyError of the scheduler's resume ends the server
            return await self.die(request, f"KeyError: {missing[0]!r} (memory region not "
                                  "released; managers/scheduler_update_weights_mixin.py)")
        self.released_tags -= set(tags)
        self.released = bool(self.released_tags)
        self.memory_log.append("resume " + ",".join(tags))
        if "weights" in tags:
            await self.engine.aresume_memory()
            if not self.weights_cpu_backup:
                await asyncio.to_thread(self._lose_weights)
        return web.json_response(None)

    def _lose_weights(self) -> None:
        """What SGLang's memory saver does to weights released without CPU backup: the
        re-mapped GPU memory does not hold them (its contents are undefined). The stand-in
        zeroes every parameter, so generation runs but answers garbage until the weights are
        pushed again; `lost_weights` names the parameters not yet re-pushed."""
        import torch

        with torch.no_grad():
            for name, p in self.engine.model.named_parameters():
                p.zero_()
                self.lost_weights.add(name)

def weights_digest(named: Any) -> str:
    """SHA-256 over (name, shape, float32 bytes) of the named tensors, in name order."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(t.shape)};".encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


#: model_executor/model_runner.py update_weights_from_tensor's answer (also for names it skips).
TENSOR_UPDATE_OK = "Success"
#: entrypoints/http_server.py /flush_cache's answer.
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")


def _versioned(msg: str, body: dict) -> str:
    """A weight update's success text: managers/tokenizer_control_mixin.py appends the new
    version when the request names one."""
    v = body.get("weight_version")
    return msg if v is None else f"{msg} Weight version updated to {v}."


def _ok(msg: str) -> web.Response:
    return web.json_response({"success": True, "message": msg})


def _fail(msg: str) -> web.Response:
    return web.json_response({"success": False, "message": msg}, status=400)


def _bad(msg: str) -> web.Response:
    return web.json_response({"object": "error", "message": msg, "code": 400}, status=400)


async def _memory_tags(request: web.Request) -> list[str] | web.Response:
    """The `tags` of a release/resume request (None or [] = all regions, as in SGLang's
    scheduler_update_weights_mixin.py), or a 400 answer naming an unknown tag."""
    text = await request.text()
    try:
        tags = (json.loads(text) or {}).get("tags") if text.strip() else None
    except (ValueError, AttributeError):
        return _bad("body must be a JSON object with optional 'tags'")
    tags = list(tags or MEMORY_TAGS)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        return _bad(f"unknown memory tag {bad[0]!r}; expected one of {list(MEMORY_TAGS)}")
    return tags


def tp_group_rendezvous(timeout_s: float = 30.0) -> None:
    """The start-up step SGLang 0.5.12 takes before loading a model: its model runner forms the
    server's tensor-parallel group with torch's `tcp://` rendezvous on a port of its own, the
    server's TP rank 0 hosting the store. In a process that inherited a torchrun worker's
    TORCHELASTIC_USE_AGENT_STORE=True no one hosts it, and the server never becomes healthy
    (here: exits with DistNetworkError after `timeout_s`)."""
    import socket
    from datetime import timedelta

    from torch.distributed import rendezvous

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 1,
                                  timeout=timedelta(seconds=timeout_s)))
    del store


def main(argv: list[str] | None = None) -> None:
    """Serve a model directory with SGLang's launch flags (unknown flags are ignored)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", "--tp", type=int, default=1)
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--enable-weights-cpu-backup", action="store_true")
    ap.add_argument("--dp-size", "--dp", type=int, default=1)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--enable-return-routed-experts", action="store_true")
    args, _unknown = ap.parse_known_args(argv)
    port_error = grpc_port_error(args.port, os.environ)
    if port_error:  # SGLang refuses the port before loading anything
        raise ValueError(port_error)
    tp_group_rendezvous()
    with open(os.path.join(args.model_path, "config.json"), encoding="utf-8") as f:
        dtype = served_dtype(args.dtype, json.load(f))  # "auto": fp32 checkpoints as fp16
    engine = EmbeddedEngine(args.model_path, dtype=dtype, seed=args.random_seed)
    server = StandinServer(engine, args.host, args.port, args.tp_size, args.model_path, True,
                           weights_cpu_backup=args.enable_weights_cpu_backup,
                           dp_size=args.dp_size, context_length=args.context_length,
                           api_key=args.api_key,
                           enable_return_routed_experts=args.enable_return_routed_experts)

    async def run() -> None:
        await server.start()
        print(f"stand-in server ready at {server.url}", flush=True)
        while True:
            await asyncio.sleep(3600)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    finally:
        time.sleep(0)


if __name__ == "__main__":
    main()
