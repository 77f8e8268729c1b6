"""Reproduce docs/results/smollm2.md: evaluate the base model, train it with GSPO
(examples/smollm2/config.yaml), run a few steps of the calculator agent
(examples/smollm2/agent.yaml), and write the numbers.

    python examples/smollm2/prepare.py        # once
    python examples/smollm2/run_study.py      # [--out runs/smollm2-study] [--steps N] [-o a.b=c]

Output: RUN/summary.json and the page docs/results/smollm2.md (--page to write elsewhere).
The machine's load is sampled every 5 s during the run and reported with the wall times, so a
number from a busy machine says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PHASES = ("time/rollout", "time/old_logprobs", "time/train", "time/weight_sync", "time/step")


class LoadSampler(threading.Thread):
    """1-minute load average every `every` seconds until stopped."""

    def __init__(self, every: float = 5.0):
        super().__init__(daemon=True)
        self.every, self.samples, self._stop = every, [], threading.Event()

    def run(self):
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def stop(self) -> dict:
        self._stop.set()
        s = self.samples or [os.getloadavg()[0]]
        return {"min": min(s), "median": statistics.median(s), "max": max(s)}


def evaluate_base(config: Path, overrides: list[str]) -> dict:
    """The run's eval metrics (same code, sampling and prompts as the in-run eval) on the
    base weights, with the embedded engine."""
    sys.path.insert(0, str(ROOT))
    from megatron_gspo.loop import build, phases
    from megatron_gspo.config import load_config
    from megatron_gspo.rollout.engine import SamplingParams
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    cfg = load_config(config, overrides)
    tok = build.tokenizer(cfg)
    engine = EmbeddedEngine(cfg.model.path, dtype=cfg.rollout.dtype, seed=cfg.train.seed,
                            default_sampling=SamplingParams.for_rollouts(cfg.rollout, tok))
    try:
        evals = build.eval_prompts(cfg, tok)
        return phases.evaluate(cfg, engine, tok, build.reward_scorer(cfg, tok), evals)
    finally:
        engine.shutdown()


def evaluate_once(path: Path, config: Path, overrides: list[str]) -> dict:
    """`evaluate_base` of `config`, kept in `path`: a rerun into the same directory reuses the
    base model's eval instead of repeating it."""
    if path.is_file():
        return json.loads(path.read_text())
    before = evaluate_base(config, overrides)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(before) + "\n")
    return before


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def train(config: Path, run_dir: Path, overrides: list[str]) -> tuple[list[dict], float]:
    """Run `megatron-gspo train` (resuming a killed run in the same directory); return
    (metrics rows, wall seconds of this invocation)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(config), "--run-dir",
           str(run_dir), "train.resume=auto", *overrides]
    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return read_rows(run_dir), time.time() - t0


def max_steps_of(run_dir: Path) -> int:
    """`train.max_steps` of the resolved config the trainer saved in the run directory."""
    import yaml

    return int(yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps"])


def summarise(rows: list[dict], wall: float, before: dict | None, load: dict | None,
              max_steps: int) -> dict:
    """Reward/eval before and after, per-phase time per step (mean over steps after the first)."""
    steady = rows[1:] or rows
    k = max(1, min(3, len(rows) // 3))
    out = {
        "steps": len(rows),
        "max_steps": max_steps,
        "samples_per_step": rows[0].get("rollout/samples"),
        "wall_s": round(wall, 1),
        "load_1min": load,
        "reward_first_steps": statistics.mean(r["reward/mean"] for r in rows[:k]),
        "reward_last_steps": statistics.mean(r["reward/mean"] for r in rows[-k:]),
        "reward_per_step": [round(r["reward/mean"], 4) for r in rows],
        "window": k,
        "response_length_first_last": [rows[0]["response_length/mean"],
                                       rows[-1]["response_length/mean"]],
        "phase_s_per_step": {p: round(statistics.mean(r.get(p, 0.0) for r in steady), 2)
                             for p in PHASES},
        "eval_before": before,
        "eval_after": {k2: v for k2, v in rows[-1].items() if k2.startswith("eval/")},
        # every in-run eval: (steps done, eval/reward_mean); the sampled reward per 5 steps
        "evals": [(r.get("step", i) + 1, r["eval/reward_mean"]) for i, r in enumerate(rows)
                  if "eval/reward_mean" in r],
        "reward_per_5_steps": [round(statistics.mean(r["reward/mean"] for r in rows[i:i + 5]),
                                     4) for i in range(0, len(rows), 5)],
    }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "smollm2-study")
    ap.add_argument("--page", type=Path, default=ROOT / "docs" / "results" / "smollm2.md")
    ap.add_argument("--agent-steps", type=int, default=12)
    ap.add_argument("--agent-only", action="store_true",
                    help="rerun only the agent (its base eval and training); the GSPO run's "
                    "numbers are kept from OUT/summary.json")
    ap.add_argument("--eval-before-only", action="store_true",
                    help="only evaluate the base model (RUN/eval_before.json)")
    ap.add_argument("--report-only", action="store_true",
                    help="write the page from the run directories as they are (no training; "
                    "wall time = sum of the recorded step times, a partial run says so)")
    ap.add_argument("--agent-dir", type=Path, default=None, help="default: OUT/agent")
    ap.add_argument("-o", "--override", action="append", default=[], help="a.b=c for the GSPO run")
    args = ap.parse_args(argv)
    if not (HERE / "base" / ".prepared.json").is_file():
        print("run_study.py: examples/smollm2/base is not prepared; run "
              "python examples/smollm2/prepare.py first", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()}}
    import torch
    import transformers
    summary["machine"]["torch"] = torch.__version__
    summary["machine"]["transformers"] = transformers.__version__
    gspo = HERE / "config.yaml"
    load = LoadSampler()
    load.start()
    before_file = args.out / "eval_before.json"
    kept = before_file.is_file()  # a rerun into the same directory keeps the base eval
    t0 = time.time()
    before = evaluate_once(before_file, gspo, args.override)
    before_s = None if kept else time.time() - t0
    if args.eval_before_only:
        print(json.dumps(before))
        return 0
    agent_dir = args.agent_dir or args.out / "agent"
    if args.report_only:  # runs already summarised by a full invocation keep their numbers
        done = args.out / "summary.json"
        if done.is_file():
            summary.update({k: v for k, v in json.loads(done.read_text()).items()
                            if k in ("gspo", "agent")})
        agent_file = args.out / "agent_eval_before.json"
        agent_before = json.loads(agent_file.read_text()) if agent_file.is_file() else None
        for key, run_dir, bef in (("gspo", args.out / "gspo", before),
                                  ("agent", agent_dir, agent_before)):
            rows = read_rows(run_dir)
            if rows and key not in summary:
                summary[key] = summarise(rows, sum(r.get("time/step", 0.0) for r in rows), bef,
                                         None, max_steps_of(run_dir))
                summary[key]["wall_is_sum_of_steps"] = True
    else:
        if args.agent_only:
            done = args.out / "summary.json"
            if not done.is_file():
                print(f"run_study.py: --agent-only needs {done} from a full run", file=sys.stderr)
                return 2
            summary["gspo"] = json.loads(done.read_text())["gspo"]
        else:
            rows, wall = train(gspo, args.out / "gspo", args.override)
            summary["gspo"] = summarise(rows, wall, before, load.stop(),
                                        max_steps_of(args.out / "gspo"))
            summary["gspo"]["eval_before_s"] = None if before_s is None else round(before_s, 1)
        if args.agent_steps:
            agent = HERE / "agent.yaml"
            agent_before = evaluate_once(args.out / "agent_eval_before.json", agent, [])
            load = LoadSampler()
            load.start()
            rows, wall = train(agent, agent_dir, [f"train.max_steps={args.agent_steps}",
                                                  f"train.eval_interval={args.agent_steps}"])
            summary["agent"] = summarise(rows, wall, agent_before, load.stop(),
                                         max_steps_of(agent_dir))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    from report import write_page  # examples/smollm2/report.py

    write_page(summary, args.page, args.out)
    print(f"wrote {args.out / 'summary.json'} and {args.page}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
