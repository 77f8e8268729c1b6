"""Synchronous vs asynchronous training (`rollout.mode`) on the tiny demo, rollouts from a
stand-in SGLang server in its own process (the SGLang client, HTTP, weight sync by
/update_weights_from_tensor), the same number of trained samples in every run.

Usage: python bench/async_rollout.py [--steps 12] [--repeats 2] [--staleness 1]
       [--threads 1] [--pin] [--keep DIR]
Runs alternate (sync, async, sync, async, ...), each a fresh `megatron-gspo train` of
examples/tiny/config.yaml against one long-lived server. Wall per step is the trainer's loop
time (sum of `time/step` over all steps, the first one included) divided by the steps.
`--threads` sets the torch threads of the trainer and of the server (OMP_NUM_THREADS): with 1
each holds one core of a 2-core machine, as an engine on GPUs of its own would. The last line
is `ratio=<async wall per step / sync wall per step>` (means over the repeats); the line
before it gives the ratio of each back-to-back pair (less sensitive to a machine whose load
changes between runs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    """A free port SGLang accepts (it adds 10000 for its gRPC port, so at most 55535)."""
    import random

    for _ in range(200):
        port = random.randint(20000, 55535)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000..55535")


def _pinned(cpus: set[int] | None):
    """preexec_fn pinning the child to `cpus` (None: no pinning)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _split_cpus(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(trainer cpus, server cpus): the machine's CPUs split in two halves when pinning."""
    if not pin:
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return set(cpus[:half]), set(cpus[half:]) or set(cpus[:half])


def start_server(threads: int, log: Path, cpus: set[int] | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """The stand-in server of the tiny model in its own process; returns (process, url)."""
    port = _port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_gspo.rollout.standin.server", "--model-path",
         str(ROOT / "examples/tiny/base"), "--port", str(port), "--dtype", "float32"],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
        preexec_fn=_pinned(cpus))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stand-in server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"stand-in server not healthy within 180 s; see {log}")


def train(mode: str, url: str, run_dir: Path, args: argparse.Namespace,
          cpus: set[int] | None = None) -> list[dict]:
    """One training run; returns its metrics rows."""
    over = [f"train.max_steps={args.steps}", "train.eval_interval=0", "checkpoint.interval=0",
            "logging.progress_bar=false", "logging.tensorboard=false", "logging.log_samples=0",
            "rollout.engine=sglang", f"rollout.server_urls=[{url}]", "rollout.colocate=false",
            "rollout.weight_sync=tensor", f"rollout.mode={mode}"]
    if mode == "async":
        over.append(f"rollout.max_staleness={args.staleness}")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", "examples/tiny/config.yaml",
           "--run-dir", str(run_dir), *over]
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log")  # a file, not a pipe: helper processes of the CPU
    with log.open("w") as f:  # tensor sync (torch_shm_manager) can outlive the trainer
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                            timeout=1800, preexec_fn=_pinned(cpus)).returncode
    if rc != 0:
        raise RuntimeError(f"{mode} run failed:\n{log.read_text()[-3000:]}")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    steps = [r["time/step"] for r in rows]
    return {"wall_per_step": sum(steps) / len(steps),
            "steady_per_step": sum(steps[1:]) / max(1, len(steps) - 1),
            "rollout_wait": sum(r["time/rollout"] for r in rows) / len(rows),
            "train": sum(r["time/train"] + r["time/old_logprobs"] for r in rows) / len(rows),
            "samples": sum(r["rollout/samples"] for r in rows),
            "reward_first": rows[0]["reward/mean"], "reward_last": rows[-1]["reward/mean"],
            "staleness_max": max(r.get("async/staleness_max", 0.0) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", default=None, help="keep run dirs and the server log here")
    ap.add_argument("--pin", action="store_true", help="trainer on the first half of the CPUs, "
                    "server on the second (as an engine on devices of its own), both modes")
    args = ap.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="async_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    trainer_cpus, server_cpus = _split_cpus(args.pin)
    proc, url = start_server(args.threads, work / "server.log", server_cpus)
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    try:
        for rep in range(args.repeats):
            for mode in ("sync", "async"):
                rows = train(mode, url, work / f"{mode}{rep}", args, trainer_cpus)
                results[mode].append(summary(rows))
                s = results[mode][-1]
                print(f"# run {rep} {mode}: {s['wall_per_step']:.3f} s/step", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"steps={args.steps} repeats={args.repeats} staleness={args.staleness} "
          f"threads={args.threads} cpus={os.cpu_count()} pinned={args.pin} "
          f"load={os.getloadavg()[0]:.2f}")
    print(f"{'mode':<6} {'run':>3} {'samples':>7} {'s/step':>7} {'steady':>7} {'wait':>6} "
          f"{'train':>6} {'stale':>5} {'reward0':>7} {'rewardN':>7}")
    for mode in ("sync", "async"):
        for i, s in enumerate(results[mode]):
            print(f"{mode:<6} {i:>3} {int(s['samples']):>7} {s['wall_per_step']:>7.3f} "
                  f"{s['steady_per_step']:>7.3f} {s['rollout_wait']:>6.3f} {s['train']:>6.3f} "
                  f"{int(s['staleness_max']):>5} {s['reward_first']:>7.3f} "
                  f"{s['reward_last']:>7.3f}")
    pairs = sorted(a["wall_per_step"] / s["wall_per_step"]
                   for s, a in zip(results["sync"], results["async"], strict=True))
    print("pair ratios (async/sync of back-to-back runs): "
          + " ".join(f"{r:.3f}" for r in pairs) + f"; median {pairs[len(pairs) // 2]:.3f}")
    mean = {m: sum(s["wall_per_step"] for s in v) / len(v) for m, v in results.items()}
    print(f"ratio={mean['async'] / mean['sync']:.3f}")


if __name__ == "__main__":
    main()
