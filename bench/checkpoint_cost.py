"""Benchmark: the time a training step loses to a checkpoint, synchronous vs asynchronous
(`checkpoint.async_save`, Megatron-Core async dist-checkpointing; issue 45).

Runs the same training three times: no checkpoint but the last, a synchronous checkpoint every
`--interval` steps, an asynchronous one every `--interval` steps. A metrics row is written after
each step and before its checkpoint, so the wall-clock `time` of the rows, from the third row
to the last, spans the same steps in every mode plus that mode's checkpoints: the difference to
the mode without checkpoints, per checkpoint, is what a checkpoint costs. An asynchronous save
waits for the previous one, so the interval must give the writer time (on the tiny demo a step
is ~0.15 s). Next to the wall-clock cost, `in loop` is the time the training loop itself spent
in checkpoint work (the rows' `time/checkpoint`: the save call, the finalize polls): what a
checkpoint blocks, without what its writer takes from training by sharing the cores. Prints
one table, the load average before and after, and, last, `ratio=` the asynchronous
checkpoint's wall-clock cost over a step (goal: under 0.10).

`--train-threads N` runs training on N threads (OMP_NUM_THREADS) and leaves the machine's
other cores to the checkpoint writer, as a GPU node's host cores are while the GPU trains:
there the writer overlaps training instead of taking cores from it.

    python bench/checkpoint_cost.py [--config examples/tiny/config.yaml] [--steps 12]
    python bench/checkpoint_cost.py --config examples/smollm2/config.yaml --steps 8 \
        rollout.max_new_tokens=16              # needs examples/smollm2/base (README)
    python bench/checkpoint_cost.py --train-threads 1 ...   # a core left to the writer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "algorithm.mini_batches=2"]
COMMON = ["logging.progress_bar=false", "logging.tensorboard=false", "train.eval_interval=0",
          "logging.log_samples=0", "checkpoint.keep_last=2"]
MODES = {"none": ["checkpoint.async_save=false"], "sync": ["checkpoint.async_save=false"],
         "async": ["checkpoint.async_save=true"]}


def times(config: str, steps: int, interval: int, mode: str, extra: list[str],
          work: Path, threads: int = 0) -> list[tuple[float, float]]:
    """(wall-clock time, the loop's seconds in checkpoint work) of each metrics row."""
    run = work / mode
    every = f"checkpoint.interval={0 if mode == 'none' else interval}"
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", config, "--run-dir", str(run),
           f"train.max_steps={steps}", every, *COMMON, *MODES[mode], *extra]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"checkpoint_cost: the {mode} run failed: {out.stderr.strip()[-600:]}")
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["time"], r.get("time/checkpoint", 0.0)) for r in rows]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "tiny" / "config.yaml"))
    ap.add_argument("--steps", type=int, default=26)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--train-threads", type=int, default=0,
                    help="training's threads (OMP_NUM_THREADS); 0: torch's default, every core")
    ap.add_argument("overrides", nargs="*", help="section.key=value (tiny: small batches)")
    args = ap.parse_args(argv)
    extra = args.overrides or (TINY if args.config.endswith("tiny/config.yaml") else [])
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ckpt_cost_") as tmp:
        t0 = time.time()
        t = {m: times(args.config, args.steps, args.interval, m, extra, Path(tmp),
                      args.train_threads) for m in MODES}
    first = 2  # rows 0 and 1: warm-up; the window holds the checkpoints after rows 2..n-2
    saves = sum(1 for s in range(first, args.steps - 1) if (s + 1) % args.interval == 0)
    span = {m: t[m][-1][0] - t[m][first][0] for m in MODES}
    # row r holds the checkpoint after row r - 1 and the polls of step r
    loop = {m: sum(c for _, c in t[m][first + 1:]) / max(saves, 1) for m in MODES}
    step = span["none"] / (args.steps - 1 - first)
    print(f"{Path(args.config).parent.name}: {args.steps} steps per mode, a checkpoint every "
          f"{args.interval} ({saves} in the window), step {step:.3f} s; training threads "
          f"{args.train_threads or 'all'} of {os.cpu_count()} cores; "
          f"{time.time() - t0:.0f} s in all; load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'mode':6s} {'window (s)':>11s} {'per checkpoint (s)':>19s} {'cost / step':>12s} "
          f"{'in loop (s)':>12s} {'in loop / step':>15s}")
    cost = {m: max(0.0, span[m] - span["none"]) / max(saves, 1) for m in MODES}
    for m in MODES:
        print(f"{m:6s} {span[m]:11.3f} {cost[m]:19.3f} {cost[m] / step:12.3f} "
              f"{loop[m]:12.3f} {loop[m] / step:15.3f}")
    print(f"ratio={cost['async'] / step:.3f}")


if __name__ == "__main__":
    main()
