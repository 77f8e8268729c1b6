"""A minimal reward service for `reward.url` (schema: docs/rewards.md), standard library only:
scores each response with the built-in `math` reward. Run it, then train with
`reward.url=http://127.0.0.1:8008/score`:

    python examples/reward_server.py --port 8008
"""

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_gspo.rewards import get_reward_fn

MATH = get_reward_fn("math")


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - the http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        kwargs = body.get("kwargs", {})
        rewards = [MATH(s["response"], s["label"], s["metadata"], **kwargs)
                   for s in body["samples"]]
        out = json.dumps(rewards).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8008)
    args = ap.parse_args()
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
