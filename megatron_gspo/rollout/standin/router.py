"""A stand-in for sglang-router 0.3.2: the behaviour of the real router that matters to the
rollout client, over real HTTP.

- `/generate` is forwarded to one healthy worker (round robin; the real router's policies only
  change which worker), its answer passed back unchanged;
- there is NO `/abort_request` (nor any other worker control endpoint): such calls get 404, so
  aborting through the router does nothing and aborts must go to the workers;
- the worker health check polls each worker's `/health` every `health_check_interval_s`
  (timeout `health_check_timeout_s`); `failure_threshold` failures in a row take a worker out
  of rotation, `success_threshold` successes bring it back (defaults from sglang_router
  router_args.py: 60 s, 5 s, 3, 2). On a SGLang 0.5.12 worker `/health` runs a generation
  (see `sglang_protocol`), which is why launched servers turn that off;
- `api_key` is sent to the workers as `Authorization: Bearer` (router_args.py `--api-key`).

Run as a process with the router's flags: `python -m megatron_gspo.rollout.standin.router
--worker-urls URL ... --host H --port P [--policy X] [--api-key K]`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import threading
from collections.abc import Sequence

import aiohttp
from aiohttp import web

_POLLER: web.AppKey[asyncio.Task] = web.AppKey("poller", asyncio.Task)


class StandinRouter:
    """aiohttp app routing /generate over `worker_urls` like sglang-router.

    Args:
        worker_urls: the workers.
        host, port: where to listen (port 0 = a free port, see `.port` after start).
        api_key: sent to the workers.
        health_check_interval_s, health_check_timeout_s, failure_threshold, success_threshold:
            the worker health check (see module docstring).
    """

    def __init__(
        self, worker_urls: Sequence[str], host: str = "127.0.0.1", port: int = 0,
        api_key: str | None = None, health_check_interval_s: float = 60.0,
        health_check_timeout_s: float = 5.0, failure_threshold: int = 3,
        success_threshold: int = 2,
    ) -> None:
        self.workers = [u.rstrip("/") for u in worker_urls]
        self.host, self.port, self._api_key = host, port, api_key
        self.interval_s, self.timeout_s = health_check_interval_s, health_check_timeout_s
        self.failure_threshold, self.success_threshold = failure_threshold, success_threshold
        self.healthy = dict.fromkeys(self.workers, True)
        self.health_checks = 0
        self._fails = dict.fromkeys(self.workers, 0)
        self._oks = dict.fromkeys(self.workers, 0)
        self._rr = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _headers(self, request: web.Request | None = None) -> dict[str, str]:
        if self._api_key:
            return {"Authorization": f"Bearer {self._api_key}"}
        auth = request.headers.get("Authorization") if request is not None else None
        return {"Authorization": auth} if auth else {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/generate", self.generate)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession()
        app[_POLLER] = asyncio.get_running_loop().create_task(self._poll())

    async def _on_cleanup(self, app: web.Application) -> None:
        app[_POLLER].cancel()
        await asyncio.gather(app[_POLLER], return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _check(self, url: str) -> None:
        assert self._session is not None
        try:
            async with self._session.get(
                url + "/health", headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok:
            self._fails[url], self._oks[url] = 0, self._oks[url] + 1
            if self._oks[url] >= self.success_threshold:
                self.healthy[url] = True
        else:
            self._oks[url], self._fails[url] = 0, self._fails[url] + 1
            if self._fails[url] >= self.failure_threshold:
                self.healthy[url] = False

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.gather(*(self._check(u) for u in self.workers))
            self.health_checks += 1

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def generate(self, request: web.Request) -> web.Response:
        live = [u for u in self.workers if self.healthy[u]]
        if not live:
            return web.json_response({"error": "No available workers"}, status=503)
        url = live[next(self._rr) % len(live)]
        assert self._session is not None
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json"),
                   **self._headers(request)}
        try:
            async with self._session.post(url + "/generate", data=body, headers=headers) as r:
                data = await r.read()
                return web.Response(body=data, status=r.status,
                                    content_type=r.content_type or "application/json")
        except aiohttp.ClientError as e:
            return web.json_response({"error": f"worker {url} failed: {e}"}, status=502)

    # ------------------------------------------------------------ serving
    async def start(self) -> None:
        """Start listening on the current event loop."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def start_in_thread(self) -> StandinRouter:
        """Serve from a daemon thread with its own event loop; returns once listening."""
        ready = threading.Event()

        async def serve() -> None:
            await self.start()
            ready.set()
            while not self._stopped.is_set():
                await asyncio.sleep(0.02)
            if self._runner is not None:
                await self._runner.cleanup()

        self._thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True,
                                        name="standin-router")
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("stand-in router did not start within 30 s")
        return self

    def stop_thread(self) -> None:
        """Stop a router started with `start_in_thread`."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def main(argv: list[str] | None = None) -> None:
    """Serve with sglang-router's flags (unknown flags are ignored)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker-urls", nargs="+", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--health-check-interval-secs", type=float, default=60.0)
    ap.add_argument("--disable-health-check", action="store_true")
    args, _unknown = ap.parse_known_args(argv)
    interval = 10.0**9 if args.disable_health_check else args.health_check_interval_secs
    router = StandinRouter(args.worker_urls, args.host, args.port, args.api_key, interval)

    async def run() -> None:
        await router.start()
        print(f"stand-in router ready at {router.url}", flush=True)
        while True:
            await asyncio.sleep(3600)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
