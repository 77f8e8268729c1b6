"""A minimal reward service for `reward.url` (schema: docs/rewards.md), standard library only:
scores each response with the built-in `math` reward. Run it, then train with
`reward.url=http://127.0.0.1:8008/score`:

    python examples/reward_server.py --port 8008

`GET /stats` answers the math-verify totals of the service (comparisons, timeouts, worker
crashes) as JSON. A thread serves each request; the math-verify worker is shared and outlives
the threads, so every thread gets the same answers.
"""

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_gspo.rewards import get_reward_fn
from megatron_gspo.rewards.verifier import verifier_counts

MATH = get_reward_fn("math")


class Handler(BaseHTTPRequestHandler):
    def _reply(self, payload) -> None:
        out = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_POST(self):  # noqa: N802 - the http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        kwargs = body.get("kwargs", {})
        self._reply([MATH(s["response"], s["label"], s["metadata"], **kwargs)
                     for s in body["samples"]])

    def do_GET(self):  # noqa: N802
        self._reply(verifier_counts(since_last=False))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8008)
    args = ap.parse_args()
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
