"""`reward.url`: the HTTP reward service client against real servers on 127.0.0.1 —
concurrency, retries on 5xx and dropped connections, timeouts, bad replies as one-line errors
naming the URL, null rewards as failed samples, and the shipped example server."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megatron_gspo.loop import build
from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.data.sample import Sample
from megatron_gspo.rewards import RewardError
from megatron_gspo.rewards.remote import RewardService

ROOT = Path(__file__).resolve().parents[2]


class Server:
    """A scripted reward service: `reply(body, call_no) -> (status, bytes)` per request;
    records in-flight peaks and request bodies."""

    def __init__(self, reply, delay_s=0.0):
        self.reply, self.delay_s = reply, delay_s
        self.bodies, self.live, self.peak, self.calls = [], 0, 0, 0
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.bodies.append(body)
                    n = outer.calls
                    outer.calls += 1
                    outer.live += 1
                    outer.peak = max(outer.peak, outer.live)
                try:
                    time.sleep(outer.delay_s)
                    status, out = outer.reply(body, n)
                    if status is None:  # drop the connection without an answer
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                finally:
                    with outer.lock:
                        outer.live -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _len_of_response(body, _n):
    return 200, json.dumps([float(len(s["response"])) for s in body["samples"]]).encode()


def _items(n):
    return [{"prompt": f"p{i}", "response": "x" * i, "label": i, "metadata": {"row": i}}
            for i in range(n)]


def test_batches_go_out_concurrently_and_rewards_keep_their_order():
    with Server(_len_of_response, delay_s=0.4) as srv:
        svc = RewardService(srv.url, batch_size=2, concurrency=4, kwargs={"scale": 2})
        t = time.monotonic()
        got = svc.score_texts(_items(8))
        took = time.monotonic() - t
    assert got == [float(i) for i in range(8)]
    assert srv.calls == 4 and srv.peak == 4, (srv.calls, srv.peak)
    assert took < 4 * 0.4  # not one after the other
    body = srv.bodies[0]
    assert body["kwargs"] == {"scale": 2}
    assert set(body["samples"][0]) == {"prompt", "response", "label", "metadata"}


def test_concurrency_is_bounded():
    with Server(_len_of_response, delay_s=0.2) as srv:
        RewardService(srv.url, batch_size=1, concurrency=2).score_texts(_items(6))
    assert srv.calls == 6 and srv.peak == 2


def test_5xx_and_dropped_connections_are_retried():
    def flaky(body, n):
        if n == 0:
            return 503, b"overloaded"
        if n == 1:
            return None, b""
        return _len_of_response(body, n)

    with Server(flaky) as srv:
        svc = RewardService(srv.url, retries=3, backoff_s=0.01)
        assert svc.score_texts(_items(3)) == [0.0, 1.0, 2.0]
    assert srv.calls == 3 and svc.stats["retries"] == 2


def test_a_service_that_keeps_failing_is_an_error_naming_the_url():
    with Server(lambda b, n: (500, b"Traceback: boom")) as srv:
        svc = RewardService(srv.url, retries=2, backoff_s=0.01)
        with pytest.raises(RewardError) as e:
            svc.score_texts(_items(2))
    msg = str(e.value)
    assert srv.url in msg and "HTTP 500" in msg and "boom" in msg and "3 attempts" in msg
    assert "\n" not in msg and srv.calls == 3


def test_4xx_is_not_retried():
    with Server(lambda b, n: (422, b"missing field label")) as srv:
        with pytest.raises(RewardError, match="HTTP 422: missing field label"):
            RewardService(srv.url, retries=3, backoff_s=0.01).score_texts(_items(1))
    assert srv.calls == 1


def test_timeout_is_retried_then_an_error():
    with Server(_len_of_response, delay_s=1.5) as srv:
        svc = RewardService(srv.url, timeout_s=0.3, retries=1, backoff_s=0.01)
        t = time.monotonic()
        with pytest.raises(RewardError,
                           match=r"no complete reply within 0.3 s \(after 2 attempts\)"):
            svc.score_texts(_items(1))
        assert time.monotonic() - t < 1.5
        assert srv.url in str(svc.url)


def test_connection_refused_names_the_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(RewardError, match=f"reward service {url}: cannot connect"):
        RewardService(url, retries=1, backoff_s=0.01).score_texts(_items(1))


@pytest.mark.parametrize("reply,match", [
    (b"<html>oops</html>", r"reply is not JSON .*starts '<html>oops</html>'"),
    (b'{"rewards": [1]}', "must be a JSON list of 1 numbers, got dict"),
    (b"[1, 2]", "reply has 2 rewards for a batch of 1 samples"),
    (b'["1"]',
     r"reward 0 of the batch \(sample 0\) is '1'; expected a finite number within .* or null"),
    (b"[true]", "reward 0 of the batch .* is True"),
    (b"[NaN]", "is nan"),
])
def test_bad_replies_are_one_line_errors(reply, match):
    with Server(lambda b, n: (200, reply)) as srv:
        with pytest.raises(RewardError, match=match) as e:
            RewardService(srv.url, retries=3).score_texts(_items(1))
    assert srv.url in str(e.value) and "\n" not in str(e.value)
    assert srv.calls == 1  # a bad reply is not retried


def _sample(i, ids, label, meta=None):
    return Sample(prompt_ids=[1], response_ids=ids, group_index=0, index=i, label=label,
                  prompt="q", metadata=dict(meta or {}))


def test_null_marks_the_sample_failed_and_failed_generations_are_not_sent():
    def some_null(body, n):
        return 200, json.dumps([None if s["label"] == "bad" else 1.0
                                for s in body["samples"]]).encode()

    samples = [_sample(0, [3], "ok"), _sample(1, [4], "bad"),
               _sample(2, [5], "ok", {"rollout_error": "aborted"})]
    with Server(some_null) as srv:
        svc = RewardService(srv.url)
        svc.score(samples, lambda ids: "r" + str(ids[0]))
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0]
    assert "gave no score" in samples[1].metadata["rollout_error"]
    assert samples[2].metadata["rollout_error"] == "aborted"
    assert [s["response"] for s in srv.bodies[0]["samples"]] == ["r3", "r4"]


def test_reward_url_config_and_the_example_server(tmp_path):
    with pytest.raises(ConfigError, match="reward.url: expected an http"):
        load_config(ROOT / "examples" / "tiny" / "config.yaml", ["reward.url=localhost:8000"])
    with pytest.raises(ConfigError, match="reward.url: not used with agent.enabled"):
        load_config(ROOT / "examples" / "multiturn_agent" / "config_cpu.yaml",
                    ["reward.url=http://127.0.0.1:1/score"])
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "reward_server.py"),
                             "--port", str(port)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        url = f"http://127.0.0.1:{port}/score"
        cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml",
                          [f"reward.url={url}", "reward.url_retries=40", "reward.url_backoff=0.25",
                           "reward.url_batch_size=1"])
        samples = [_sample(0, [1], "46"), _sample(1, [2], "12"), _sample(2, [3], "0.5")]
        texts = {1: "so 46", 2: "maybe 13", 3: r"\boxed{\frac{1}{2}}"}

        class Tok:
            def decode(self, ids, skip_special_tokens=True):
                return texts[ids[0]]

        build.reward_scorer(cfg, Tok())(samples)  # retried until the server is up
        assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    finally:
        proc.terminate()
        proc.wait(10)
