"""An HTTP reward service (`reward.url`): samples are POSTed in batches as JSON, the service
answers with one reward per sample. The schema is in docs/rewards.md; examples/reward_server.py
is a minimal server.

Request (POST `reward.url`, Content-Type application/json):

    {"samples": [{"prompt": str, "response": str, "label": any, "metadata": {...}}, ...],
     "kwargs": {...}}                                  # reward.kwargs, passed through

Reply: a JSON list with one entry per sample, in order: a finite number, or null when the
service could not score that sample (the sample is then marked failed, like a refused
generation: its group is dropped from training and it is left out of evaluation, so one
unscorable sample never ends a run).

Batches go out `concurrency` at a time; a request that gets a 5xx status, a connection error or
no complete answer within `timeout_s` (in all, not per read) is retried `retries` times with
exponential back-off. When the service still fails, or answers with a 4xx status, text that
is not JSON, a list of the wrong length or entries that are not numbers, the scoring raises a
one-line RewardError naming the URL: a failing service is never a silent reward of 0.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megatron_gspo.data.sample import MAX_ABS_REWARD, Sample
from megatron_gspo.rewards.scoring import RewardError

FAILED_KEY = "rollout_error"  # the failed-sample mark that group sampling and evaluation honour


def _finite(v: int | float) -> bool:
    """A number within [-MAX_ABS_REWARD, MAX_ABS_REWARD] (JSON integers have no size limit)."""
    try:
        return math.isfinite(float(v)) and abs(float(v)) <= MAX_ABS_REWARD
    except OverflowError:
        return False


def _describe(v: Any) -> str:
    """A reward entry for an error message (a huge JSON integer by its length)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"an integer of {len(str(abs(v)))} digits"
    return f"{v!r:.40}"


class _Retryable(Exception):
    """A 5xx status, a connection error or a timeout (worth another attempt)."""


class RewardService:
    """Client of one HTTP reward service.

    Args:
        url: the service's endpoint (http:// or https://).
        batch_size: samples per request.
        concurrency: requests in flight at once.
        timeout_s: seconds one request may take in all (connect, send, the whole reply).
        retries: further attempts after a retryable failure.
        backoff_s: wait before the first retry; doubled for each further one.
        kwargs: passed to the service as the request's "kwargs" (config reward.kwargs).
    """

    def __init__(self, url: str, batch_size: int = 64, concurrency: int = 8,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5,
                 kwargs: dict[str, Any] | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"reward.url: expected an http:// or https:// URL, got {url!r}")
        if batch_size < 1 or concurrency < 1 or timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise RewardError("reward service: batch_size and concurrency must be >= 1, "
                              "timeout_s > 0, retries and backoff_s >= 0")
        self.url, self.batch_size, self.concurrency = url, batch_size, concurrency
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.kwargs = dict(kwargs or {})
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "retries": 0, "samples_unscored": 0}

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _post(self, body: bytes) -> bytes:
        """One attempt within `timeout_s` in all (connect, headers and body: a reply that
        trickles in a byte at a time is cut off at the deadline); raises _Retryable or
        RewardError."""
        import http.client
        import urllib.parse

        u = urllib.parse.urlsplit(self.url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = cls(u.hostname, u.port, timeout=self.timeout_s)
        expired = threading.Event()

        def cut_off() -> None:  # wakes a blocked read: the deadline is for the whole request
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(self.timeout_s, cut_off)
        timer.daemon = True
        self._count("requests")
        timer.start()
        try:
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if expired.is_set():
                raise TimeoutError
        except (TimeoutError, socket.timeout):
            raise _Retryable(f"no complete reply within {self.timeout_s} s") from None
        except (ConnectionRefusedError, socket.gaierror) as e:
            if expired.is_set():
                raise _Retryable(f"no complete reply within {self.timeout_s} s") from None
            raise _Retryable(f"cannot connect ({e})") from None
        except (http.client.HTTPException, ConnectionError, OSError) as e:  # reset, closed
            if expired.is_set():
                raise _Retryable(f"no complete reply within {self.timeout_s} s") from None
            raise _Retryable(f"connection failed ({type(e).__name__}: {e})") from None
        finally:
            timer.cancel()
            conn.close()
        if resp.status >= 400:
            text = " ".join(data[:300].decode("utf-8", "replace").split())
            what = f"HTTP {resp.status}" + (f": {text}" if text else "")
            if resp.status >= 500:
                raise _Retryable(what)
            raise RewardError(f"reward service {self.url}: {what}")
        return data

    def _request(self, items: list[dict[str, Any]], first: int) -> list[float | None]:
        """Score one batch (samples first .. first + len(items) - 1) with retries."""
        body = json.dumps({"samples": items, "kwargs": self.kwargs}, default=str).encode()
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                raw = self._post(body)
                break
            except _Retryable as e:
                if attempt == self.retries:
                    raise RewardError(f"reward service {self.url}: {e} (after "
                                      f"{self.retries + 1} attempts)") from None
                self._count("retries")
                time.sleep(delay)
                delay *= 2
        return self._parse(raw, len(items), first)

    def _parse(self, raw: bytes, n: int, first: int) -> list[float | None]:
        where = f"reward service {self.url}"
        try:
            values = json.loads(raw)
        except RecursionError:
            raise RewardError(f"{where}: reply is nested too deep ({len(raw)} bytes); expected "
                              f"a flat JSON list of {n} numbers") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too many digits
            head = " ".join(raw[:60].decode("utf-8", "replace").split())
            raise RewardError(f"{where}: reply is not JSON ({e.__class__.__name__} at "
                              f"{getattr(e, 'pos', 0)}; starts {head!r})") from None
        if not isinstance(values, list):
            raise RewardError(f"{where}: reply must be a JSON list of {n} numbers, got "
                              f"{type(values).__name__}")
        if len(values) != n:
            raise RewardError(f"{where}: reply has {len(values)} rewards for a batch of {n} "
                              "samples")
        out: list[float | None] = []
        for j, v in enumerate(values):
            if v is None:
                out.append(None)
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
                raise RewardError(f"{where}: reward {j} of the batch (sample {first + j}) is "
                                  f"{_describe(v)}; expected a finite number within "
                                  f"[{-MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}] or null")
            out.append(float(v))
        return out

    def score_texts(self, items: Sequence[dict[str, Any]]) -> list[float | None]:
        """Rewards of request items ({"prompt", "response", "label", "metadata"}), in order;
        None where the service gave null."""
        starts = range(0, len(items), self.batch_size)
        batches = [(list(items[i:i + self.batch_size]), i) for i in starts]
        if len(batches) <= 1:
            return [v for b, i in batches for v in self._request(b, i)]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(batches)),
                                thread_name_prefix="reward-http") as pool:
            parts = list(pool.map(lambda bi: self._request(*bi), batches))
        return [v for part in parts for v in part]

    def score(self, samples: Sequence[Sample], detokenize: Callable[[list[int]], str]) -> None:
        """Fill `reward` of every sample; a sample the service could not score gets reward 0
        and the failed-sample mark (metadata "rollout_error"). Samples already marked failed
        (refused or aborted generations) are not sent and get reward 0."""
        todo = [s for s in samples if FAILED_KEY not in s.metadata]  # failed generations
        for s in samples:
            if FAILED_KEY in s.metadata:
                s.reward = 0.0
        items = [{"prompt": s.prompt, "response": detokenize(list(s.response_ids)),
                  "label": s.label, "metadata": dict(s.metadata)} for s in todo]
        for s, v in zip(todo, self.score_texts(items), strict=True):
            if v is None:
                s.reward = 0.0
                s.metadata.setdefault(FAILED_KEY, f"reward service {self.url} gave no score")
                self._count("samples_unscored")
            else:
                s.reward = v
