"""Launch N worker processes (one rank each, gloo on 127.0.0.1) running a case of
`tests/megatron/_workers.py`, and collect each rank's JSON report."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).with_name("_workers.py")


def free_port(limit: int | None = None) -> int:
    """A free local port; with `limit`, one at most that (SGLang and the stand-in take ports
    up to 55535: they add 10000 for gRPC)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if limit is None or port <= limit:
            return port


def launch(case: str, nprocs: int, outdir: Path, *, timeout: float = 240.0,
           extra_env: dict | None = None) -> list[dict]:
    """Run `_workers.py <case> <outdir>` on `nprocs` ranks; return the per-rank reports.

    Raises AssertionError with the ranks' stderr tails when a rank fails or times out.
    """
    outdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore",
                   CUDA_VISIBLE_DEVICES="")  # CPU + gloo unless extra_env says otherwise
        env.update(extra_env or {})
        log = open(outdir / f"{case}.rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, str(WORKERS), case, str(outdir)],
                                       cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
                       log))
    failed = []
    for rank, (p, log) in enumerate(procs):
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                if q.poll() is None:
                    q.kill()
            rc = "timeout"
        log.close()
        if rc != 0:
            failed.append(rank)
    if failed:
        tails = []
        for r in failed:
            text = (outdir / f"{case}.rank{r}.log").read_text()
            tails.append(f"--- rank {r} ---\n{text[-3000:]}")
        raise AssertionError(f"case {case}: ranks {failed} failed\n" + "\n".join(tails))
    return [json.loads((outdir / f"{case}.rank{r}.json").read_text()) for r in range(nprocs)]
