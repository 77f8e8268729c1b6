"""The SGLang rollout engine: launched or attached servers, an async HTTP client, weight sync.

Generation: one `POST /generate` per sample (n=1 each, so a failed sample is retried alone and
SGLang's radix cache shares the prompt prefix) with `input_ids`, `sampling_params`,
`return_logprob: true` and a unique `rid`; the answer's `meta_info.output_token_logprobs`
([logprob, token_id, text] per generated token; text is null since `return_text_in_logprobs`
is not asked for) gives the response ids and log-probs, `meta_info.finish_reason.type` the
finish reason. Requests go to the least-busy server (or to the router when one is configured),
at most `max_concurrency` at once. Each sample slot is filled exactly once. With
`sample_seeds` set (`train.deterministic`) each sample carries its own `sampling_seed`.

Failures: connection errors, timeouts, bodies cut mid-way, 5xx, non-JSON or malformed answers
(token ids outside the vocabulary, more tokens than max_new_tokens) and finish reason `abort`
are retried with exponential backoff, at most `max_retries` times; a timed-out request is
aborted first, on its server or, behind a router (which has no /abort_request), on every
worker. A request SGLang refuses with 400 (e.g. longer than the context), or one still aborted
after the retries, becomes a per-sample failure: a Sample with finish reason `abort`, loss mask
0 and `metadata["rollout_error"]`, counted in `metrics` ("failed", "aborted") — never the run's
end. Exhausted retries on anything else and 401/403 fail the call with one error naming the
sample and server (launched servers are then stopped).

At start the client reads `GET /server_info` of every server: tp_size must equal the
configured one and dp_size be 1 (else refused with one line); the context length (reported,
else the local model config's, else `context_length`) bounds requests before they are sent: a
prompt that does not fit is a per-sample failure, a too-large max_new_tokens is capped. A
prompt with a token id outside the vocabulary would end the server: a per-sample failure, never
sent. With `api_key` every request carries `Authorization: Bearer <key>` (never logged).

Weights (SGLang's endpoints, `sglang_weights`): `/update_weights_from_tensor` with flattened
buckets (colocated), `/init_weights_update_group` + `/update_weights_from_distributed` (NCCL
broadcast from the learner), `/update_weights_from_disk`; generation is paused around an update
and the prefix cache flushed after it. `/release_memory_occupation` and
`/resume_memory_occupation` free and take back GPU memory in colocated mode (never sent to
SGLang's CPU engine, which has none to free and which they end on 0.5.23: `compat`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import aiohttp

from megatron_gspo.data.sample import Sample
from megatron_gspo.rollout.engine import (
    MEMORY_TAGS,
    GenerateRequest,
    RolloutEngine,
    RolloutError,
    SampleSeeds,
    SamplingParams,
    make_sample,
    plan_slots,
)
from megatron_gspo.rollout.sglang import versions as compat
from megatron_gspo.rollout.sglang.launch import LaunchSpec, ServerProcess
from megatron_gspo.rollout.sglang.protocol import (decode_json, decode_routed_experts, http_error,
                                                    parse_generate_output, prompt_ids_error)
from megatron_gspo.rollout.sglang.lifecycle import RETRYABLE, SGLangServers
from megatron_gspo.rollout.sglang.weight_sync_endpoints import SGLangWeightSync

log = logging.getLogger(__name__)

__all__ = ["SGLangEngine", "parse_generate_output"]


#: Seconds an idle pooled connection is reused. SGLang's uvicorn closes idle keep-alive
#: connections after 5 s (environ.py SGLANG_TIMEOUT_KEEP_ALIVE); a request written on one the
#: server is closing fails ("Can not write request body"). The pool drops them well before.
KEEPALIVE_S = 2.0


class _Retryable(Exception):
    """A transient failure of one attempt (5xx, connection error, timeout, broken answer)."""


class _Refused(Exception):
    """The server refused this one request (HTTP 400): a per-sample failure."""


class SGLangEngine(SGLangServers, SGLangWeightSync, RolloutEngine):
    """Rollouts from SGLang servers.

    Args:
        server_urls: attach to these running servers (no launch).
        launch: launch servers as described (ignored when server_urls is given).
        router_url: send /generate through this sglang-router instead of the servers.
        launch_router: start an sglang-router over the launched servers (port router_port).
        router_port, router_policy: router settings.
        tp_size: tp size of attached servers (launched ones use launch.tp_size).
        max_concurrency: most /generate requests in flight.
        request_timeout_s: timeout of one /generate request.
        max_retries: attempts after the first for one sample.
        backoff_s: first retry delay (doubles, capped at 10 s).
        startup_timeout_s: how long launched servers may take to become healthy.
        default_sampling: for requests without sampling params.
        weight_sync: what `update_weights` uses: "tensor" (colocated, flattened CUDA buckets)
            or "distributed" (NCCL broadcast; connects on first use to dist_master).
        dist_master: (address, port) of the learner's weight-update group (distributed mode).
        dist_backend: backend of that group ("nccl"; "gloo" for CPU tests).
        api_key: SGLang's --api-key: sent with every request, passed to launched servers and
            router (None: launch.api_key for launched servers, else none).
        context_length: context length to check requests against when the servers do not
            report one and their model config is not readable here (None: no check).
        vocab_size: generated token ids must be below this (None: only checked >= 0).
        return_routing: ask every request for `return_routed_experts` (MoE; servers started
            with --enable-return-routed-experts) and set `Sample.routing`.
        routing_shape: (layers, top-k) the decoded routing must have.
    """

    def __init__(
        self,
        server_urls: Sequence[str] | None = None,
        launch: LaunchSpec | None = None,
        router_url: str | None = None,
        launch_router: bool = False,
        router_port: int = 0,
        router_policy: str = "cache_aware",
        tp_size: int = 1,
        max_concurrency: int = 256,
        request_timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        startup_timeout_s: float = 900.0,
        weight_sync: str = "tensor",
        dist_master: tuple[str, int] | None = None,
        dist_backend: str = "nccl",
        default_sampling: SamplingParams | None = None,
        api_key: str | None = None,
        context_length: int | None = None,
        vocab_size: int | None = None,
        return_routing: bool = False,
        routing_shape: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(default_sampling)
        if not server_urls and launch is None:
            raise ValueError("SGLangEngine needs server_urls (attach) or a LaunchSpec (launch)")
        if max_concurrency < 1 or max_retries < 0:
            raise ValueError("max_concurrency must be >= 1 and max_retries >= 0")
        self.urls = [u.rstrip("/") for u in (server_urls or [])]
        self.spec = None if server_urls else launch
        self.tp_size = self.spec.tp_size if self.spec else tp_size
        self.router_url = router_url.rstrip("/") if router_url else None
        self.launch_router, self.router_port, self.router_policy = (
            launch_router, router_port, router_policy)
        self.max_concurrency, self.request_timeout_s = max_concurrency, request_timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.startup_timeout_s = startup_timeout_s
        if weight_sync not in ("tensor", "distributed"):
            raise ValueError(f"rollout.weight_sync must be 'tensor' or 'distributed', got "
                             f"{weight_sync!r}")
        if weight_sync == "distributed" and dist_master is None:
            raise ValueError("rollout.weight_sync='distributed' needs dist_master (address, port)")
        self.weight_sync, self.dist_master, self.dist_backend = (
            weight_sync, dist_master, dist_backend)
        self.procs: list[ServerProcess] = []
        self.router_proc: ServerProcess | None = None
        self._version = 0
        self._inflight: dict[str, int] = {}
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closed = False
        self._batches = itertools.count()
        # rids unique across engines and processes (pids repeat across containers): SGLang
        # 0.5.12 answers 400 to a rid it holds, and holds for good the rid of a request it
        # refused for its length (tokenizer_manager.py registers it before the check)
        self._rid_prefix = f"mg-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tasks: set[asyncio.Future] = set()
        self._update_group: Any = None
        self._open_updates: list[str] = []  # servers with an open weight-update session
        self._has_update_sessions: dict[str, bool] = {}  # url -> /begin_weight_update exists
        self._group_name = "weight_update_group"
        self._api_key = api_key or (self.spec.api_key if self.spec else None)
        self.context_length = context_length  # replaced by what the servers report at start
        self.vocab_size = vocab_size
        self.server_info: dict[str, dict] = {}
        self.metrics = {"retries": 0, "requests": 0, "aborted": 0, "failed": 0, "capped": 0}
        self.return_routing, self.routing_shape = return_routing, routing_shape
        self.sample_seeds: SampleSeeds | None = None  # set per step by the loop

    # ---------------------------------------------------------------- state
    @property
    def weight_version(self) -> int:
        return self._version

    def _sess(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            auth = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrency + 16,
                                               keepalive_timeout=KEEPALIVE_S), headers=auth,
            )
            self._session_loop = loop
        return self._session

    # ------------------------------------------------------------ generation
    def _pick(self, avoid: str | None) -> str:
        if self.router_url:
            return self.router_url
        cands = [u for u in self.urls if u != avoid] or self.urls
        return min(cands, key=lambda u: self._inflight.get(u, 0))

    def _fit_context(self, prompt_len: int, sp: dict[str, Any]) -> str | None:
        """Cap `sp["max_new_tokens"]` to the context length; an error when the prompt alone
        does not fit (SGLang would answer 400)."""
        ctx = self.context_length
        if ctx is None:
            return None
        if prompt_len >= ctx:
            return (f"prompt of {prompt_len} tokens does not fit the servers' context length "
                    f"{ctx}; not sent")
        if prompt_len + sp["max_new_tokens"] > ctx:
            sp["max_new_tokens"] = ctx - prompt_len
            self.metrics["capped"] += 1
        return None

    async def agenerate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        await self.astart()
        if self.memory_released:
            raise RolloutError("generate called while the servers' memory is released; "
                               "resume_memory first")
        slots, params = plan_slots(requests, self.default_sampling)
        batch = next(self._batches)
        seeds = self.sample_seeds.next_call() if self.sample_seeds is not None else None
        sem = asyncio.Semaphore(self.max_concurrency)
        results: list[Sample | None] = [None] * len(slots)

        async def one(slot: Any) -> None:
            req = requests[slot.request_idx]
            p = params[slot.request_idx]
            sp = (p if seeds is None else replace(p, seed=seeds(slot.out_idx))).to_sglang()
            body = {"input_ids": list(req.prompt_ids), "sampling_params": sp,
                    "return_logprob": True}
            if self.return_routing:
                body["return_routed_experts"] = True
            error = prompt_ids_error(req.prompt_ids, self.vocab_size) or self._fit_context(
                len(req.prompt_ids), sp)
            routing = None
            if error is None:
                async with sem:
                    ids, lps, reason, url, ver, error, routing = await self._generate_one(
                        body, batch, slot)
            else:
                ids, lps, reason, url, ver = [], [], "abort", None, None
            s = make_sample(req, slot.request_idx, slot.out_idx, ids, lps, reason,
                            self._parse_version(ver), {"server": url})
            if routing is not None:
                s.routing = routing
                s.validate()
            if error is not None:  # a per-sample failure: kept, masked, counted
                self.metrics["failed"] += 1
                s.loss_mask = [0] * len(ids)
                s.metadata["rollout_error"] = error
                log.warning("rollout sample failed: %s", error)
            results[slot.out_idx] = s

        tasks = [asyncio.ensure_future(one(s)) for s in slots]
        self._tasks.update(tasks)
        try:
            await asyncio.gather(*tasks)
        except BaseException as e:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._closed:
                raise RolloutError("generation aborted: the rollout engine was shut down") from e
            if isinstance(e, RolloutError) and self.procs:
                await self._stop_processes()
                raise RolloutError(f"{e}; stopped the rollout servers this engine launched") from e
            raise
        finally:
            self._tasks.difference_update(tasks)
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RolloutError(f"rollout lost samples {missing[:10]}")
        return [r for r in results if r is not None]

    async def _generate_one(self, body: dict[str, Any], batch: int, slot: Any) -> tuple:
        """(ids, log-probs, finish reason, url, weight version, per-sample error or None,
        routing or None)."""
        where = f"sample {slot.out_idx} (request {slot.request_idx})"
        max_new = body["sampling_params"]["max_new_tokens"]
        last_err, avoid = "", None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.metrics["retries"] += 1
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), 10.0))
            dead = self._dead_server()
            if dead is not None:
                raise RolloutError(f"{where}: {dead.describe()}")
            url = self._pick(avoid)
            rid = f"{self._rid_prefix}-{batch}-{slot.out_idx}-{attempt}"
            self._inflight[url] = self._inflight.get(url, 0) + 1
            try:
                out = await self._post_generate(url, {**body, "rid": rid}, where)
                try:
                    ids, lps, reason, ver = parse_generate_output(
                        out, f"{where} from {url}", max_new, self.vocab_size)
                    routing = decode_routed_experts(
                        out, f"{where} from {url}", len(body["input_ids"]) + len(ids),
                        self.routing_shape) if self.return_routing and reason != "abort" \
                        else None
                except RolloutError as e:
                    raise _Retryable(str(e)) from e
            except _Retryable as e:
                last_err, avoid = f"{url}: {e}", url
                if isinstance(e.__cause__, asyncio.TimeoutError):
                    await self._abort(url, rid)
                continue
            except _Refused as e:
                return [], [], "abort", url, None, f"{where}: {e}", None
            finally:
                self._inflight[url] -= 1
            if reason != "abort":
                return ids, lps, reason, url, ver, None, routing
            self.metrics["aborted"] += 1
            last_err = f"{url}: finish reason abort"
            if attempt == self.max_retries:
                return ids, lps, reason, url, ver, (
                    f"{where}: aborted by {url} {attempt + 1} times; kept with loss mask 0"), None
        if (dead := await self._exited_server()) is not None:  # a crashed server, exit code
            raise RolloutError(f"{where}: {dead.describe()}")
        raise RolloutError(f"{where}: /generate failed {self.max_retries + 1} times; last error: "
                           f"{last_err}")

    async def _post_generate(self, url: str, body: dict[str, Any], where: str) -> Any:
        self.metrics["requests"] += 1
        try:
            async with self._sess().post(
                url + "/generate", json=body,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            ) as r:
                text = await r.text()
                status = r.status
        except RETRYABLE as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from e
        except UnicodeDecodeError as e:
            raise _Retryable(f"answer is not UTF-8 text ({e})") from e
        if status >= 500:
            raise _Retryable(f"HTTP {status}: {text[:200]}")
        if status == 400:
            raise _Refused(f"{url}/generate refused the request (HTTP 400): {text[:300]}")
        if status != 200:
            raise RolloutError(f"{where}: {http_error(url + '/generate', status, text)}")
        try:
            return decode_json(text)
        except ValueError as e:
            raise _Retryable(str(e)) from None

    async def _abort(self, url: str, rid: str) -> None:
        """Abort `rid` where it runs: on `url`, or on every worker when `url` is the router
        (sglang-router has no /abort_request)."""
        targets = self.urls if url == self.router_url else [url]
        await asyncio.gather(*(self._abort_on(u, rid) for u in targets))

    async def _abort_on(self, url: str, rid: str) -> None:
        try:
            await self._post(url, "/abort_request", {"rid": rid}, timeout=5.0)
        except Exception:  # best effort: the server may be gone
            pass

    def _parse_version(self, ver: str | None) -> int:
        return int(ver) if ver is not None and ver.isdigit() else self._version

    # ------------------------------------------------------------- plumbing
    async def _post(self, url: str, path: str, body: dict[str, Any] | None = None,
                    timeout: float = 600.0, get: bool = False) -> Any:
        """One control call; raises RolloutError on failure or `success: false`."""
        method = self._sess().get if get else self._sess().post
        try:
            async with method(url + path, json=None if get else (body or {}),
                              timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                text = await r.text()
                if r.status != 200:
                    raise RolloutError(http_error(url + path, r.status, text))
        except (*RETRYABLE, aiohttp.ClientError) as e:
            raise RolloutError(f"{url}{path} failed: {type(e).__name__}: {e}") from e
        try:
            data = decode_json(text) if text.strip() else None
        except ValueError:
            return text
        if isinstance(data, dict) and data.get("success") is False:
            raise RolloutError(f"{url}{path}: {data.get('message', data)}")
        return data

    async def _all(self, path: str, body: dict[str, Any] | None = None, **kw: Any) -> list[Any]:
        await self.astart()
        return list(await asyncio.gather(*(self._post(u, path, body, **kw) for u in self.urls)))

    # ---------------------------------------------------------------- memory
    async def arelease_memory(self, tags: Sequence[str] | None = None) -> None:
        busy = sum(self._inflight.values())
        if busy:  # SGLang's scheduler asserts it is idle (and dies when it is not)
            raise RolloutError(f"release_memory with {busy} generate requests in flight; "
                               "wait for them first")
        await self._memory_call(self.urls, "/release_memory_occupation",
                                {"tags": list(tags) if tags else None})
        self.released_tags |= set(tags or MEMORY_TAGS)  # what aresume_memory may resume

    async def aresume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Resume released regions (None: every released one). Resuming a region that is not
        released ends an SGLang server (KeyError in its scheduler): refused, never sent."""
        if tags:
            missing = [t for t in tags if t not in self.released_tags]
            if missing:
                raise RolloutError(f"resume_memory of {missing[0]!r}, which is not released, "
                                   "would end the SGLang servers; not sent")
        todo = list(tags) if tags else sorted(self.released_tags)
        if not todo:
            return
        await self._memory_call(self.urls, "/resume_memory_occupation", {"tags": todo})
        self.released_tags -= set(todo)

    async def _memory_call(self, urls: Sequence[str], path: str, body: dict[str, Any]) -> None:
        """POST a memory release/resume to those of `urls` that take one (not SGLang's CPU
        engine: `compat.sends_memory_calls`); the released tags are kept all the same."""
        await self.astart()
        await asyncio.gather(*(self._post(u, path, body) for u in urls
                               if compat.sends_memory_calls(self.server_info.get(u, {}))))

    # -------------------------------------------------------------- shutdown
    async def ashutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started and any(self._inflight.values()):
            for u in self.urls:
                try:
                    await self._post(u, "/abort_request", {"abort_all": True}, timeout=5.0)
                except RolloutError:
                    pass
        for t in list(self._tasks):
            t.cancel()
        await asyncio.sleep(0)
        await self._stop_processes()
        self.close_update_group()
        if self._session is not None and not self._session.closed:
            await self._session.close()

    def sync(self, coro: Any) -> Any:
        """Run one of this engine's extra coroutines (weight/disk/distributed) synchronously."""
        return self._run(coro)
