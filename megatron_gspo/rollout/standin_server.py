"""A stand-in SGLang server: the native HTTP endpoints the rollout client uses, with the same
JSON shapes (matches SGLang's http_server.py / io_struct.py), backed by the embedded engine.

It lets the SGLang client be exercised over real HTTP with a real model on CPU, and has
switchable faults for reliability tests (POST /standin/faults or `StandinServer.faults`):
`error_5xx` (answer the next k /generate calls with 503), `drop` (close the next k
/generate connections without answering), `slow` (delay the next k /generate answers by
`delay_s` seconds), `crash` (stop serving at once; as a subprocess the process exits with
code 1).

Weights and memory, as strict as SGLang 0.5.12: `/update_weights_from_tensor` decodes every TP
rank's entry with SGLang's unpickler allow-list and the byte-layout flattened bucket
(`weight_sync.py`); `/release_memory_occupation` / `/resume_memory_occupation` honour the tags
`kv_cache`, `weights`, `cuda_graph` (none = all; resuming a region that is not released is
refused); generation is refused while any region is released, a weight update while `weights`
is; weights released without `--enable-weights-cpu-backup` come back zeroed (SGLang's re-mapped
memory does not hold them), so answers are garbage until the weights are pushed again.

Concurrent /generate calls are micro-batched into one embedded-engine batch. Run as a process
with SGLang's launch flags: `python -m megatron_gspo.rollout.standin_server --model-path DIR
--port P [--host H] [--tp-size N] ...` (unknown SGLang flags are accepted and ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from megatron_gspo.rollout.base import MEMORY_TAGS, SamplingParams
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.weight_sync import decode_tensor_update, init_learner_update_group


_BATCHER: web.AppKey[asyncio.Task] = web.AppKey("batcher", asyncio.Task)


@dataclass
class Faults:
    """Switchable faults of the stand-in server (see module docstring)."""

    error_5xx: int = 0
    drop: int = 0
    slow: int = 0
    delay_s: float = 1.0
    crash: bool = False


def _params(d: dict[str, Any]) -> SamplingParams:
    top_k = int(d.get("top_k", -1))
    return SamplingParams(
        max_new_tokens=int(d.get("max_new_tokens", 128)),
        temperature=float(d.get("temperature", 1.0)),
        top_p=float(d.get("top_p", 1.0)),
        top_k=top_k if top_k > 0 else -1,
        n=int(d.get("n", 1)),
        stop_token_ids=tuple(d.get("stop_token_ids") or ()),
        ignore_eos=bool(d.get("ignore_eos", False)),
    )


class StandinServer:
    """aiohttp app serving an `EmbeddedEngine` under SGLang's endpoint names.

    Args:
        engine: the backing engine.
        host, port: where to listen (port 0 = a free port, see `.port` after start).
        tp_size: reported tensor-parallel size (number of payload entries expected).
        model_path: reported model path.
        exit_on_crash: on the `crash` fault, end the process (subprocess mode).
        weights_cpu_backup: `--enable-weights-cpu-backup`: weights survive a release of the
            `weights` region (else they are lost, see `release`).
    """

    def __init__(
        self, engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0, tp_size: int = 1,
        model_path: str = "", exit_on_crash: bool = False, weights_cpu_backup: bool = False,
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

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------ app setup
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_get("/get_server_info", self.server_info)
        r.add_route("*", "/generate", self.generate)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_route("*", "/release_memory_occupation", self.release)
        r.add_route("*", "/resume_memory_occupation", self.resume)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.cont)
        r.add_post("/abort_request", self.abort)
        r.add_post("/standin/faults", self.set_faults)
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
        self._runner = web.AppRunner(self.app(), access_log=None)
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

    # ------------------------------------------------------------ generation
    async def _batcher(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0.005)  # let concurrent requests join the batch
            while self._paused:
                await asyncio.sleep(0.01)
            batch, self._queue = self._queue, []
            if not batch:
                continue
            rows = [row for rows, _, _ in batch for row in rows]
            try:
                outs = await asyncio.to_thread(self.engine.sample_rows, rows)
            except Exception as e:  # answered to every waiting request
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            k = 0
            for rows_i, fut, _ in batch:
                if not fut.done():
                    fut.set_result(outs[k : k + len(rows_i)])
                k += len(rows_i)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        f = self.faults
        if f.crash:
            return await self._crash(request)
        if f.drop > 0:
            f.drop -= 1
            request.transport.close()  # type: ignore[union-attr]
            raise asyncio.CancelledError()
        if f.error_5xx > 0:
            f.error_5xx -= 1
            return web.json_response({"error": {"message": "injected fault"}}, status=503)
        body = await request.json()
        if body.get("stream"):
            return _bad("stand-in server does not stream")
        ids = body.get("input_ids")
        if not ids:
            return _bad("input_ids is required")
        single = isinstance(ids[0], int)
        prompts = [ids] if single else ids
        sp = body.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        if len(sps) != len(prompts):
            return _bad(f"{len(sps)} sampling_params for {len(prompts)} prompts")
        try:
            params = [_params(d) for d in sps]
        except (TypeError, ValueError) as e:
            return _bad(str(e))
        if self.released:
            return _bad("memory is released; call /resume_memory_occupation first")
        rows = [
            (list(p), s.with_n(1))
            for p, s in zip(prompts, params, strict=True)
            for _ in range(s.n)
        ]
        self.stats["generate_calls"] += 1
        rid = body.get("rid") or uuid.uuid4().hex
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((rows, fut, rid))
        assert self._wake is not None
        self._wake.set()
        slow = f.slow > 0
        if slow:
            f.slow -= 1
        outs = await fut
        if slow:
            await asyncio.sleep(f.delay_s)
        results = []
        for i, ((prompt, _), (tok, lps, reason)) in enumerate(zip(rows, outs, strict=True)):
            fr: dict[str, Any] = {"type": reason}
            if reason == "stop":
                fr["matched"] = tok[-1]
            elif reason == "length":
                fr["length"] = len(tok)
            meta = {
                "id": rid if len(rows) == 1 else f"{rid}-{i}",
                "finish_reason": fr,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tok),
                "cached_tokens": 0,
                "weight_version": self.weight_version,
            }
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(lps, tok, strict=True)
                ]
            results.append({"text": "", "output_ids": tok, "meta_info": meta})
        self.stats["samples"] += len(results)
        return web.json_response(results[0] if single and len(results) == 1 else results)

    async def _crash(self, request: web.Request) -> web.StreamResponse:
        if self.exit_on_crash:
            os._exit(1)
        request.transport.close()  # type: ignore[union-attr]
        self._stopped.set()  # the serving thread then closes the listener
        raise asyncio.CancelledError()

    # ------------------------------------------------------------ control
    async def health(self, request: web.Request) -> web.Response:
        if self.faults.crash:
            return await self._crash(request)  # type: ignore[return-value]
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": self.model_path, "is_generation": True,
             "weight_version": self.weight_version}
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": self.model_path, "tp_size": self.tp_size, "version": "standin",
             "weight_version": self.weight_version}
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.stats["flushes"] += 1
        return web.Response(text="Cache flushed.\n")

    async def _load(self, named: list, version: Any) -> None:
        if "weights" in self.released_tags:  # SGLang would write into unmapped GPU memory
            raise RuntimeError("the weights region is released; resume 'weights' first")
        await asyncio.to_thread(self.engine.load_buckets, [named], self.engine.weight_version)
        self.lost_weights.difference_update(n for n, _ in named)
        self.stats["weight_updates"] += 1
        if version is not None:
            self.weight_version = str(version)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:  # every TP rank deserializes its own entry (SGLang tp_worker.py)
            ranks = [decode_tensor_update(body, tp_rank=k) for k in range(self.tp_size)]
            for k, other in enumerate(ranks[1:], 1):
                if [n for n, _ in other] != [n for n, _ in ranks[0]] or not all(
                        a.equal(b) for (_, a), (_, b) in zip(ranks[0], other, strict=True)):
                    raise ValueError(f"TP rank {k}'s entry holds other tensors than rank 0's")
            await self._load(ranks[0], body.get("weight_version"))
        except Exception as e:
            return _fail(f"Failed to update weights from tensor: {e}")
        return _ok("Succeeded to update model weights.")

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
            {"success": True, "message": "Succeeded to update model weights.",
             "num_paused_requests": 0})

    async def init_group(self, request: web.Request) -> web.Response:
        b = await request.json()
        try:
            name = b.get("group_name", "weight_update_group")
            pg = await asyncio.to_thread(
                init_learner_update_group, b["master_address"], int(b["master_port"]),
                int(b["world_size"]), name, b.get("backend", "nccl"), int(b["rank_offset"]),
            )
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
        return _ok("Succeeded to update parameter online from distributed.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        import torch.distributed as dist

        name = (await request.json()).get("group_name", "weight_update_group")
        pg = self._groups.pop(name, None)
        if pg is None:
            return _fail(f"Group {name} not found")
        dist.destroy_process_group(pg)
        return _ok("Succeeded to destroy custom process group.")

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
        if missing:  # SGLang: offload_tags.remove(tag) raises in the scheduler
            return _bad(f"memory region {missing[0]!r} is not released")
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

    async def pause(self, request: web.Request) -> web.Response:
        text = await request.text()
        mode = (await request.json()).get("mode", "abort") if text.strip() else "abort"
        if mode == "abort":  # requests not yet started come back with finish reason abort
            for rows, fut, _ in self._queue:
                if not fut.done():
                    fut.set_result([([], [], "abort")] * len(rows))
            self._queue = []
        self._paused = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(self, request: web.Request) -> web.Response:
        self._paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        b = await request.json()
        keep = []
        for rows, fut, rid in self._queue:  # only requests not yet started can be aborted
            if b.get("abort_all") or rid == b.get("rid"):
                if not fut.done():
                    fut.set_result([([], [], "abort")] * len(rows))
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
    args, _unknown = ap.parse_known_args(argv)
    dtype = "float32" if args.dtype in ("auto", "float") else args.dtype
    engine = EmbeddedEngine(args.model_path, dtype=dtype, seed=args.random_seed)
    server = StandinServer(engine, args.host, args.port, args.tp_size, args.model_path, True,
                           weights_cpu_backup=args.enable_weights_cpu_backup)

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
