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
import collections
import json
import os
import threading
import time
from typing import Any

import torch
from aiohttp import web

from megatron_gspo.quant.fp8_stream import Fp8Receiver
from megatron_gspo.rollout.engine import SamplingParams
from megatron_gspo.rollout.fp8_model import is_block_fp8_dir
from megatron_gspo.rollout.served_shapes import checkpoint_shapes
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.sglang.protocol import grpc_port_error, served_dtype
from megatron_gspo.rollout.standin.control import ControlEndpoints
from megatron_gspo.rollout.standin.draft import DraftEndpoints, DraftNextN, load_draft
from megatron_gspo.rollout.standin.generate import (
    Faults,
    GenerationEndpoints,
    api_key_middleware,
    json_not_found,
)
from megatron_gspo.rollout.standin.weight_sync_server import (  # noqa: F401
    ServedModel,
    WeightEndpoints,
    weights_digest,
)


_BATCHER: web.AppKey[asyncio.Task] = web.AppKey("batcher", asyncio.Task)


class StandinServer(GenerationEndpoints, ControlEndpoints, WeightEndpoints, DraftEndpoints):
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
        device: `--device` (cuda | cpu): a cpu server ends on input-token log-probs, as
            SGLang 0.5.12's CPU engine does.
        weight_update_sessions: behave as SGLang 0.5.23: tensor and distributed updates only
            between /begin_weight_update and /end_weight_update.
        custom_weight_loaders: `--custom-weight-loader MODULE.FUNC ...`: tensor updates with
            that load_format call FUNC(model, named_tensors).
        deterministic_inference: `--enable-deterministic-inference`: a request's
            `sampling_seed` seeds its own sampling stream (else it is ignored, as upstream).
        served_model_name: `--served-model-name`, echoed by /server_info (None: the model
            path, as server_args.py `__post_init__` sets it).
        draft: the speculative draft (`--speculative-algorithm NEXTN`: `standin.draft`).
        speculative: the resolved speculative fields /server_info reports (algorithm EAGLE,
            num_steps, eagle_topk, num_draft_tokens).
    """

    def __init__(
        self, engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0, tp_size: int = 1,
        model_path: str = "", exit_on_crash: bool = False, weights_cpu_backup: bool = False,
        dp_size: int = 1, context_length: int | None = None, api_key: str | None = None,
        health_generation: bool | None = None, enable_return_routed_experts: bool = False,
        device: str = "cuda", weight_update_sessions: bool = False,
        custom_weight_loaders: Any = (), deterministic_inference: bool = False,
        served_model_name: str | None = None, draft: DraftNextN | None = None,
        speculative: dict | None = None,
    ) -> None:
        self.draft, self.speculative = draft, dict(speculative or {})
        self.deterministic_inference = deterministic_inference
        self.served_model_name = model_path if served_model_name is None else served_model_name
        self.device, self.weight_update_sessions = device, weight_update_sessions
        self.session_open = False
        self.custom_weight_loaders = list(custom_weight_loaders or ())  # --custom-weight-loader
        self.served_model = ServedModel(self)  # what SGLang's runner calls `model`
        self.engine, self.host, self.port, self.tp_size = engine, host, port, tp_size
        self.model_path, self.exit_on_crash = model_path, exit_on_crash
        # a block-FP8 checkpoint served as SGLang's fp8 method would hold it: each FP8 weight
        # and its weight_scale_inv are parameters (dequantized here once both arrived: W8A16)
        self.fp8_rx = (Fp8Receiver(torch.float32) if model_path and is_block_fp8_dir(model_path)
                       else None)
        self.fp8_scales = {n: s for n, s in (checkpoint_shapes(model_path) or {}).items()
                           if n.endswith("_scale_inv")} if self.fp8_rx is not None else {}
        self.faults = Faults()
        self.weight_version = "default"
        self.stats = {"generate_calls": 0, "samples": 0, "weight_updates": 0, "flushes": 0}
        # (load_format, per TP rank `weights.origins` of its entry) of the latest tensor updates
        self.received: collections.deque = collections.deque(maxlen=256)
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
        if self.weight_update_sessions:  # SGLang 0.5.23's; 0.5.12 answers 404
            r.add_post("/begin_weight_update", self.begin_session)
            r.add_post("/end_weight_update", self.end_session)
        r.add_post("/standin/faults", self.set_faults)
        r.add_get("/standin/weights_digest", self.weights_digest)
        r.add_route("*", "/weights_checker", self.weights_checker)
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
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weight-update-sessions", action="store_true")  # as SGLang 0.5.23
    ap.add_argument("--custom-weight-loader", nargs="*", default=None)
    ap.add_argument("--enable-deterministic-inference", action="store_true")
    ap.add_argument("--served-model-name", default=None)
    for flag in ("algorithm", "num-steps", "eagle-topk", "num-draft-tokens"):
        ap.add_argument(f"--speculative-{flag}", default=None)
    args, _unknown = ap.parse_known_args(argv)
    port_error = grpc_port_error(args.port, os.environ)
    if port_error:  # SGLang refuses the port before loading anything
        raise ValueError(port_error)
    if args.served_model_name and ":" in args.served_model_name:  # server_args.py check_server_args
        raise ValueError("served_model_name cannot contain a colon (':') character. The colon "
                         "is reserved for the 'model:adapter' syntax used in LoRA adapter "
                         f"specification. Invalid value: '{args.served_model_name}'")
    tp_group_rendezvous()
    with open(os.path.join(args.model_path, "config.json"), encoding="utf-8") as f:
        dtype = served_dtype(args.dtype, json.load(f))  # "auto": fp32 checkpoints as fp16
    engine = EmbeddedEngine(args.model_path, dtype=dtype, seed=args.random_seed)
    draft, spec = None, None
    if args.speculative_algorithm:  # server_args.py: NEXTN is EAGLE, the draft the target's
        spec = {"algorithm": "EAGLE" if args.speculative_algorithm.upper() in ("NEXTN", "EAGLE")
                else args.speculative_algorithm.upper(),
                "num_steps": int(args.speculative_num_steps or 1),
                "eagle_topk": int(args.speculative_eagle_topk or 1)}
        spec["num_draft_tokens"] = (spec["num_steps"] + 1 if spec["eagle_topk"] == 1 else
                                    int(args.speculative_num_draft_tokens))
        draft = load_draft(args.model_path, getattr(torch, dtype))
    server = StandinServer(engine, args.host, args.port, args.tp_size, args.model_path, True,
                           weights_cpu_backup=args.enable_weights_cpu_backup,
                           dp_size=args.dp_size, context_length=args.context_length,
                           api_key=args.api_key,
                           enable_return_routed_experts=args.enable_return_routed_experts,
                           device=args.device,
                           weight_update_sessions=args.weight_update_sessions,
                           custom_weight_loaders=args.custom_weight_loader,
                           deterministic_inference=args.enable_deterministic_inference,
                           served_model_name=args.served_model_name, draft=draft,
                           speculative=spec)

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
