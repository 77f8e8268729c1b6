"""Benchmark: the cost of the weight-sync probe (`rollout.verify_sync_interval`) against a step.

    python bench/sync_probe_cost.py [--config examples/tiny/config.yaml] [--steps 12]
        [--engines embedded,standin] [--threads 2] [--rounds 2]

Trains the config's run (`train.run`, in this process) for `--steps` steps per engine:
`embedded` (the config's engine: no servers, so no probe: the probe reads served log-probs)
and `standin` (SGLang engine, stand-in servers launched by the run through SGLANG_SERVER_MODULE,
colocated tensor sync, as tests/convert/test_smollm2.py runs them) with the probe off and at
every sync. Every `loop.weight_sync_phase.verify_sync` call is timed (the probe's generation on
every server,
the learner's recompute, the comparison and its broadcast). The first step of each run is left
out of the step times (start-up, first sync).

One row per run: engine, verify_sync_interval, steps, median and mean step time (ms), median
weight-sync time (ms), probes, median probe time (ms), median time of its generation on the
servers (ms), probe time as a share of the median step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STANDIN = "megatron_gspo.rollout.standin.server"
QUIET = ["logging.tensorboard=false", "logging.progress_bar=false", "logging.log_samples=0",
         "train.eval_interval=0", "checkpoint.interval=0"]


def run_once(config: str, steps: int, engine: str, interval: int) -> dict:
    """One run of `steps` steps; returns its row."""
    from megatron_gspo.config import load_config
    from megatron_gspo.loop import weight_sync_phase as sync_mod
    from megatron_gspo.loop import train

    over = [*QUIET, f"train.max_steps={steps}", f"rollout.verify_sync_interval={interval}"]
    if engine == "standin":
        os.environ["SGLANG_SERVER_MODULE"] = STANDIN
        over += ["rollout.engine=sglang", "rollout.colocate=true", "rollout.weight_sync=tensor",
                 "rollout.startup_timeout=600"]
    cfg = load_config(config, over)
    probes: list[float] = []
    real = sync_mod.verify_sync

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            probes.append(time.perf_counter() - t)

    from megatron_gspo.rollout.sglang.client import SGLangEngine

    gens: list[float] = []
    real_gen = SGLangEngine.aprobe_servers

    async def timed_gen(self, *a, **k):
        t = time.perf_counter()
        try:
            return await real_gen(self, *a, **k)
        finally:
            gens.append(time.perf_counter() - t)

    sync_mod.verify_sync, SGLangEngine.aprobe_servers = timed, timed_gen
    try:
        with tempfile.TemporaryDirectory() as work:
            run_dir = train.run(cfg, str(Path(work) / "run"))
            import json

            rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        sync_mod.verify_sync, SGLangEngine.aprobe_servers = real, real_gen
        os.environ.pop("SGLANG_SERVER_MODULE", None)
    step = [r["time/step"] for r in rows[1:]]
    wsync = [r.get("time/weight_sync", 0.0) for r in rows[1:]]
    med = statistics.median(step)
    probe = statistics.median(probes) if probes else 0.0
    return {"engine": engine, "interval": interval, "steps": len(rows),
            "step_ms": 1e3 * med, "step_mean_ms": 1e3 * statistics.mean(step),
            "sync_ms": 1e3 * statistics.median(wsync), "probes": len(probes),
            "probe_ms": 1e3 * probe, "probe_share": probe / med if med else 0.0,
            "probe_gen_ms": 1e3 * statistics.median(gens) if gens else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "tiny" / "config.yaml"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--engines", default="embedded,standin")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="stand-in runs per interval")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors to the servers
    os.chdir(ROOT)  # the config's relative paths
    runs = [("embedded", 0)] if "embedded" in args.engines else []
    for _ in range(args.rounds):  # interleaved: the machine's load changes between runs
        runs += [("standin", 0), ("standin", 1)] if "standin" in args.engines else []
    head = ("engine    interval steps step_ms(median) step_ms(mean) sync_ms probes probe_ms "
            "probe_gen_ms probe/step")
    rows = []
    for engine, interval in runs:
        r = run_once(args.config, args.steps, engine, interval)
        rows.append(f"{r['engine']:9s} {r['interval']:8d} {r['steps']:5d} {r['step_ms']:15.1f} "
                    f"{r['step_mean_ms']:13.1f} {r['sync_ms']:7.1f} {r['probes']:6d} "
                    f"{r['probe_ms']:8.1f} {r['probe_gen_ms']:12.1f} "
                    f"{100 * r['probe_share']:9.2f}%")
        print("ROW " + rows[-1], flush=True)
    print(head)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
