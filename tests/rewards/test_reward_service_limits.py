"""`reward.url` replies and services at the edges: numbers too large for a float and replies
nested too deep are one-line errors naming the URL; a service that trickles its reply is cut
off by the total per-request deadline; the example server scores right answers right whatever
thread asks."""

import json
import time

import pytest

from megatron_gspo.rewards import RewardError
from megatron_gspo.rewards.remote import RewardService

from tests.rewards.test_reward_service import Server, _items


@pytest.mark.parametrize("reply,match", [
    (b"[1" + b"0" * 400 + b"]",
     r"reward 0 of the batch \(sample 0\) is an integer of 401 digits; expected a finite"),
    (b"[1" + b"0" * 5000 + b"]", "reply is not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "reply is nested too deep"),
])
def test_replies_a_float_cannot_hold_are_one_line_errors(reply, match):
    with Server(lambda b, n: (200, reply)) as srv:
        with pytest.raises(RewardError, match=match) as e:
            RewardService(srv.url, retries=1).score_texts(_items(1))
    assert srv.url in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400


def test_a_trickling_reply_meets_the_total_deadline():
    """A service that sends its reply one byte a second never stalls a single read; the
    deadline `timeout_s` covers the whole request (connect, headers and body)."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            body = json.dumps([1.0] * 1).encode()
            reply = (b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
            try:
                conn.recv(65536)
                for i in range(len(reply)):
                    if stop.is_set():
                        break
                    conn.sendall(reply[i:i + 1])
                    time.sleep(0.25)
            except OSError:
                pass
            finally:
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}/score"
    try:
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"no complete reply within 1.0 s \(after 2 "
                                              r"attempts\)"):
            RewardService(url, timeout_s=1.0, retries=1, backoff_s=0.01).score_texts(_items(1))
        assert time.monotonic() - t0 < 4.0  # two attempts of 1 s each, not 2 x 20 s
    finally:
        stop.set()
        srv.close()


def test_example_server_scores_right_answers_on_every_thread(tmp_path):
    """examples/reward_server.py serves each request on its own thread; the answers that only
    math-verify can judge come out right on every request, and GET /stats reports no crash."""
    import os
    import socket
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, str(root / "examples" / "reward_server.py"),
                             "--port", str(port)], cwd=root,
                            env=dict(os.environ, PYTHONPATH=str(root)))
    try:
        url = f"http://127.0.0.1:{port}/score"
        svc = RewardService(url, retries=40, backoff_s=0.25, timeout_s=60)
        items = [{"prompt": "q", "response": r"so \boxed{2\sqrt{2}}", "label": r"\sqrt{8}",
                  "metadata": {}}]
        got = [svc.score_texts(items)[0] for _ in range(16)]
        assert got == [1.0] * 16
        stats = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/stats",
                                                  timeout=30).read())
        assert stats["rewards/verifier_crashes"] == 0 and stats["rewards/verifier_calls"] >= 16
    finally:
        proc.terminate()
        proc.wait(10)
