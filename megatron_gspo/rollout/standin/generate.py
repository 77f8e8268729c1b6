"""The generation side of the stand-in SGLang server (`standin.server.StandinServer` mixes it
in; `control.ControlEndpoints` has /health, /model_info, /server_info and the control calls):
`/generate` (micro-batched into one embedded-engine batch), switchable faults and the
`--api-key` check.

Strict where SGLang 0.5.12 is (rules in `sglang_protocol`, each naming its upstream file):
over-long requests get SGLang's 400; `/health` runs a one-token generation unless
`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` is false (`/health_generate` always does), and that
generation fails while memory is released; `/release_memory_occupation` is refused while any
request is in flight (`release_if_idle`; upstream the scheduler asserts it is idle,
managers/scheduler_update_weights_mixin.py); with an API key every path but /health* needs
`Authorization: Bearer <key>` (401 otherwise); `/server_info` reports tp_size, dp_size and the
`--context-length` argument (null when not given), as upstream's dump of its server args.

Faults (POST /standin/faults or `.faults`), each counting down per /generate call: `error_5xx`
(503), `drop` (close the connection), `slow` (answer `delay_s` late), `abort` (finish reason
abort with half the output, as after /abort_request), `cut` (body cut mid-way), `garbage`
(200 with a non-JSON body), `nested` (200 with JSON nested too deeply to parse), `bad_ids` (a
negative token id); `crash` stops serving (a subprocess exits with code 1). `health_race`
counts down per health generation instead: the request lands in the scheduler's loop iteration
right after a batch, where SGLang only queues it (managers/scheduler.py
`process_input_requests`), so it is answered at the end of the next batch and gets 503 after
the health timeout (`SGLANG_HEALTH_CHECK_TIMEOUT`, 20 s) when none runs.
"""

from __future__ import annotations

import asyncio
import base64
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from megatron_gspo.rollout.engine import SamplingParams
from megatron_gspo.rollout.sglang.protocol import (
    HEALTH_CHECK_TIMEOUT_ENV,
    HEALTH_CHECK_TIMEOUT_S,
    HEALTH_GENERATION_ENV,
    auth_allowed,
    context_length_of,
    env_bool,
    length_error,
    prompt_ids_error,
)



@dataclass
class Faults:
    """Switchable faults of the stand-in server (see module docstring)."""

    error_5xx: int = 0
    drop: int = 0
    slow: int = 0
    delay_s: float = 1.0
    crash: bool = False
    abort: int = 0
    cut: int = 0
    garbage: int = 0
    nested: int = 0
    bad_ids: int = 0
    health_race: int = 0


#: managers/schedule_batch.py FINISH_ABORT.to_json() of an aborted request.
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
#: managers/tokenizer_manager.py `_handle_abort_req`: a request aborted while still in the
#: waiting queue (scheduler.py `abort_request` sends a bare AbortReq); its meta_info holds only
#: these keys (plus the log-prob fields when asked).
WAITING_ABORTED = {"type": "abort", "message": "Abort in waiting queue"}
#: meta_info keys SGLang 0.5.12 adds to every /generate answer (values of a CPU server).
EXTRA_META = {"cached_tokens_details": None, "dp_rank": None, "e2e_latency": 0.0,
              "num_retractions": 0, "reasoning_tokens": 0, "response_sent_to_client_ts": 0.0}
#: The 400 body of a control endpoint called without its JSON body (FastAPI's validation
#: error as entrypoints/http_server.py's RequestValidationError handler words it).
MISSING_BODY = {"object": "error", "message": "1 validation error:\n  {'type': 'missing', "
                "'loc': ('body',), 'msg': 'Field required', 'input': None}", "type": "Bad Request",
                "param": None, "code": 400}


@web.middleware
async def json_not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    """404 with FastAPI's JSON body `{"detail": "Not Found"}`, as SGLang answers."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)


def _params(d: dict[str, Any], deterministic: bool = False) -> SamplingParams:
    """A request's sampling_params; `sampling_seed` counts only on a server started with
    --enable-deterministic-inference (sampling/sampling_batch_info.py: else None)."""
    top_k = int(d.get("top_k", -1))
    seed = d.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"sampling_seed must be an integer, got {seed!r}")  # 0.5.23 verify()
    return SamplingParams(
        max_new_tokens=int(d.get("max_new_tokens", 128)),
        temperature=float(d.get("temperature", 1.0)),
        top_p=float(d.get("top_p", 1.0)),
        top_k=top_k if top_k > 0 else -1,
        n=int(d.get("n", 1)),
        stop_token_ids=tuple(d.get("stop_token_ids") or ()),
        ignore_eos=bool(d.get("ignore_eos", False)),
        seed=seed % 2**63 if deterministic and seed is not None else None,
    )


def _bad(msg: str) -> web.Response:
    return web.json_response({"object": "error", "message": msg, "code": 400}, status=400)


def _error(msg: str, status: int = 400) -> web.Response:
    """entrypoints/http_server.py `_create_error_response`."""
    return web.json_response({"error": {"message": msg}}, status=status)


def api_key_middleware(api_key: str) -> Any:
    """aiohttp middleware answering 401 like SGLang's utils/auth.py (health stays open)."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if not auth_allowed(request.path, request.headers.get("Authorization"), api_key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


class GenerationEndpoints:
    """Mixin of `StandinServer`: the generation and information endpoints."""

    engine: Any
    faults: Faults
    stats: dict[str, int]
    released: bool
    weight_version: str
    model_path: str
    tp_size: int
    exit_on_crash: bool
    _queue: list
    _wake: asyncio.Event | None
    _paused: bool
    _stopped: Any

    def _init_generation(self, dp_size: int, context_length: int | None,
                         health_generation: bool | None) -> None:
        self.dp_size = dp_size
        self.context_length_arg = context_length
        self.context_length = context_length or context_length_of(
            self.engine.model.config.to_dict())
        if health_generation is None:
            health_generation = env_bool(os.environ, HEALTH_GENERATION_ENV, True)
        self.health_generation = health_generation
        self.aborts: list[str] = []  # rids of /abort_request calls ("*" for abort_all)
        self.live_rids: set[str] = set()  # tokenizer_manager.py rid_to_state
        self.in_flight = 0
        self.health_timeout_s = float(os.environ.get(HEALTH_CHECK_TIMEOUT_ENV,
                                                     HEALTH_CHECK_TIMEOUT_S))
        # health requests queued by `health_race`, answered one per finished batch
        # (scheduler.py maybe_send_health_check_signal pops one per batch result)
        self._health_waiting: list[asyncio.Future] = []
        self.stats.update(health_generations=0)

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
            # --enable-return-routed-experts captures every forward's top-k (SGLang's
            # RoutedExpertsCapturer); a request gets them only when it asks
            routed = getattr(self, "enable_return_routed_experts", False) and bool(
                getattr(self.engine, "_routers", None))
            try:
                outs = await asyncio.to_thread(self._sample, rows, routed)
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
            while self._health_waiting:
                waiter = self._health_waiting.pop(0)
                if not waiter.done():
                    waiter.set_result(None)
                    break

    def _sample(self, rows: list, routed: bool) -> list:
        """One micro-batch; with --enable-deterministic-inference row by row, so a row's
        tokens and log-probs do not depend on what shares its batch (SGLang's batch-invariant
        kernels, `--enable-deterministic-inference`): the same numbers after a restart."""
        if not getattr(self, "deterministic_inference", False):
            return self.engine.sample_rows(rows, routed)
        return [out for row in rows for out in self.engine.sample_rows([row], routed)]

    async def _run_rows(self, rows: list, rid: str) -> list:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((rows, fut, rid))
        assert self._wake is not None
        self._wake.set()
        return await fut

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
        broken = await self._broken_answer(request)
        if broken is not None:
            return broken
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
            params = [_params(d, self.deterministic_inference) for d in sps]
        except (TypeError, ValueError) as e:
            return _bad(str(e))
        rid = body.get("rid") or uuid.uuid4().hex
        keys = [rid] if isinstance(rid, str) else [str(r) for r in rid]
        dup = next((k for k in keys if k in self.live_rids), None)
        if dup is not None:  # managers/tokenizer_manager.py _init_req_state
            return _error(f"Duplicate request ID detected: {dup}")
        # the request's state is registered before its length is checked, and a request the
        # check refuses never drops it (SGLang 0.5.12): its rid stays taken for good
        self.live_rids.update(keys)
        for p, d in zip(prompts, sps, strict=True):
            msg = length_error(len(p), d.get("max_new_tokens"), self.context_length)
            if msg:
                return _error(msg)
        try:
            return await self._generate_rows(request, body, rid, single, prompts, sps, params)
        finally:
            self.live_rids.difference_update(keys)

    async def _generate_rows(self, request: web.Request, body: dict, rid: str, single: bool,
                             prompts: list, sps: list, params: list) -> web.StreamResponse:
        """The checked request's rows through the batcher, answered as SGLang does."""
        f = self.faults
        bad = next((e for e in (prompt_ids_error(p, self.engine.vocab_size) for p in prompts)
                    if e), None)
        if bad:  # upstream the embedding's IndexError ends the scheduler, and the server
            return await self.die(request, f"IndexError in the embedding: {bad}")
        if self.released:
            return _bad("memory is released; call /resume_memory_occupation first")
        start = body.get("logprob_start_len", -1)
        if getattr(self, "device", "cuda") == "cpu" and body.get("return_logprob") and max(
                start if isinstance(start, list) else [start]) >= 0:
            # a prefill with input-token log-probs indexes with CUDA tensors on the CPU engine
            # (layers/logits_processor.py _get_pruned_states): the scheduler dies
            return await self.die(request, "RuntimeError: Found no NVIDIA driver on your system "
                                  "(input-token log-probs on a CPU server)")
        rows = [
            (list(p), s.with_n(1))
            for p, s in zip(prompts, params, strict=True)
            for _ in range(s.n)
        ]
        skips = [bool(d.get("skip_special_tokens", True))
                 for d, s in zip(sps, params, strict=True) for _ in range(s.n)]
        self.stats["generate_calls"] += 1
        slow, aborted, bad_ids = f.slow > 0, f.abort > 0, f.bad_ids > 0
        f.slow, f.abort, f.bad_ids = f.slow - slow, f.abort - aborted, f.bad_ids - bad_ids
        self.in_flight += 1
        try:
            outs = await self._run_rows(rows, rid)
            if slow:
                await asyncio.sleep(f.delay_s)
        finally:
            self.in_flight -= 1
        results = []
        for i, ((prompt, _), (tok, lps, reason, *routed)) in enumerate(
                zip(rows, outs, strict=True)):
            fr: dict[str, Any] = {"type": reason}
            if reason == "abort_waiting":
                meta = {"id": rid if len(rows) == 1 else f"{rid}_{i}",
                        "finish_reason": dict(WAITING_ABORTED),
                        "weight_version": self.weight_version, "e2e_latency": 0.0,
                        "completion_tokens": 0}
                if body.get("return_logprob"):
                    meta.update(input_token_logprobs=[], output_token_logprobs=[])
                results.append({"text": "", "output_ids": [], "meta_info": meta})
                continue
            if aborted or reason == "abort":  # as after /abort_request: part of the output
                if aborted:
                    tok, lps = tok[: len(tok) // 2], lps[: len(tok) // 2]
                fr = dict(ABORTED)
            elif reason == "stop":
                fr["matched"] = tok[-1]
            elif reason == "length":
                fr["length"] = len(tok)
            if bad_ids and tok:
                tok = [-1, *tok[1:]]
            meta = {
                "id": rid if len(rows) == 1 else f"{rid}_{i}",  # io_struct.py _normalize_rid
                "finish_reason": fr,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tok),
                "cached_tokens": 0,
                "weight_version": self.weight_version,
                **EXTRA_META,
            }
            if body.get("return_logprob"):  # text is null unless return_text_in_logprobs
                meta["output_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(lps, tok, strict=True)
                ]
                meta["input_token_logprobs"] = []
                meta["output_token_logprobs_length"] = len(tok)
            if body.get("return_routed_experts") and routed and not aborted:
                # SGLang 0.5.12 (scheduler_output_processor_mixin.maybe_collect_routed_experts,
                # detokenizer_manager._b64_encode_per_request): int32 [prompt + completion - 1,
                # layers, top-k] as base64. Without --enable-return-routed-experts the
                # capturer is None and the field is silently absent (no refusal).
                meta["routed_experts"] = base64.b64encode(
                    routed[0].to(torch.int32).numpy().tobytes()).decode("ascii")
            results.append({"text": self.decode(tok, skips[i]), "output_ids": tok,
                            "meta_info": meta})
        self.stats["samples"] += len(results)
        return web.json_response(results[0] if single and len(results) == 1 else results)

    async def _broken_answer(self, request: web.Request) -> web.StreamResponse | None:
        """The `cut`, `garbage` and `nested` faults (None when none is armed)."""
        f = self.faults
        if f.garbage > 0:
            f.garbage -= 1
            return web.Response(text="<html>502 Bad Gateway</html>", content_type="text/html")
        if f.nested > 0:
            f.nested -= 1
            return web.Response(text="[" * 100_000 + "]" * 100_000,
                                content_type="application/json")
        if f.cut > 0:
            f.cut -= 1
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 1000
            await resp.prepare(request)
            await resp.write(b'{"meta_info": {"output_token_logprobs": [[-0.5, 3, null], ')
            request.transport.close()  # type: ignore[union-attr]
            return resp
        return None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The decoded text of `ids` (SGLang's `text`), "" when the model has no tokenizer.
        As SGLang's detokenizer, special tokens are left out unless the request's sampling
        params set `skip_special_tokens: false` (sampling/sampling_params.py, default True)."""
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = None
            if any(os.path.isfile(os.path.join(self.model_path, f))
                   for f in ("tokenizer.json", "tokenizer_config.json")):
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path,
                                                                local_files_only=True)
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode([t for t in ids if t >= 0],
                                      skip_special_tokens=skip_special_tokens)

    async def die(self, request: web.Request, why: str) -> web.StreamResponse:
        """End the server without an answer, as SGLang's scheduler does on an exception (the
        process exits; a server in a thread stops serving); `why` goes to stderr."""
        import sys

        print(f"stand-in server: ending, as SGLang's scheduler would: {why}", file=sys.stderr,
              flush=True)
        self.died = why
        return await self._crash(request)

    async def _crash(self, request: web.Request) -> web.StreamResponse:
        if self.exit_on_crash:
            os._exit(1)
        request.transport.close()  # type: ignore[union-attr]
        self._stopped.set()  # the serving thread then closes the listener
        raise asyncio.CancelledError()
