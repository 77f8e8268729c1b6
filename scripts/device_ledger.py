"""What one GPU of each shipped colocated config would hold at every moment of the loop, from a
CPU run: the device-memory ledger (megatron_gspo/runtime/device_ledger.py).

    .venv/bin/python scripts/device_ledger.py [--json OUT] [--configs NAME ...]

For each shipped GPU config (examples/qwen3_gpu, 80 GB GPUs) `megatron-gspo plan --ledger-spec`
sizes a ledger; the tiny model then trains colocated with a stand-in SGLang server
(tests/rollout/_ledger_worker.py: 2 steps with a checkpoint and a sync probe at every step,
then resumed to 3 steps), with the config's memory switches (offload outside the optimizer
step, KL reference, LoRA), so that the loop makes the calls that config makes. Configs with the
same switches share one run. Prints one table per config (peak per moment, the plan's figure,
the difference) and the problems; exits 1 when there is one. About 20 s a run on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "examples" / "qwen3_gpu"
WORKER = ROOT / "tests" / "rollout" / "_ledger_worker.py"
CONFIGS = {"qwen3_8b_1node": ("Qwen3-8B", 1), "qwen3_30b_a3b_1node": ("Qwen3-30B-A3B", 1),
           "qwen3_30b_a3b_2nodes": ("Qwen3-30B-A3B", 2),
           # a hybrid: SGLang's KV of the full-attention layers + the delta-net state at launch
           # (its switches are qwen3_30b_a3b_1node's: the same run, no extra time)
           "qwen3_5_35b_a3b_2nodes": ("Qwen3.5-35B-A3B", 2)}
GiB = 2**30


def write_spec(out: Path, config: str, overrides=()) -> Path:
    """`megatron-gspo plan CONFIG --ledger-spec OUT` for 80 GB GPUs."""
    shape, nodes = CONFIGS[config]
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "plan", str(GPU / f"{config}.yaml"),
           *overrides, "--model-config", str(GPU / "shapes" / shape), "--gpu-memory", "80GB",
           "--nodes", str(nodes), "--ledger-spec", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return out


def switches(config: str) -> list[str]:
    """The config's settings that change the memory calls of the loop, as overrides."""
    from megatron_gspo.config import load_config

    cfg = load_config(GPU / f"{config}.yaml", [])
    out = [f"optimizer.offload_outside_step={str(cfg.optimizer.offload_outside_step).lower()}"]
    if cfg.rollout.offload_learner is not None:
        out.append(f"rollout.offload_learner={str(cfg.rollout.offload_learner).lower()}")
    if cfg.algorithm.kl_coef:
        out.append(f"algorithm.kl_coef={cfg.algorithm.kl_coef}")
    if cfg.model.lora.rank:
        out.append(f"model.lora.rank={cfg.model.lora.rank}")
    return out


def run_worker(work: Path, specs: list[Path], overrides: list[str]) -> dict:
    """One tiny colocated run with the ledgers of `specs`; returns the worker's RESULT."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2",
               MEGATRON_GSPO_DEVICE_LEDGER=os.pathsep.join(map(str, specs)))
    out = subprocess.run([sys.executable, str(WORKER), str(work), json.dumps(overrides)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"ledger run {overrides} failed:\n{out.stderr[-3000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def reports(configs: list[str], work: Path) -> dict[str, dict[str, dict]]:
    """{config: {"fresh": report, "resume": report}}."""
    groups: dict[tuple, list[str]] = {}
    for c in configs:
        groups.setdefault(tuple(switches(c)), []).append(c)
    got: dict[str, dict] = {}
    for i, (sw, cs) in enumerate(groups.items()):
        run = work / f"run{i}"
        for phase, steps in (("fresh", 2), ("resume", 3)):
            specs = [write_spec(run.parent / f"{phase}-{c}.json", c) for c in cs]
            run_worker(run, specs, [f"train.max_steps={steps}", *sw])
            for c, s in zip(cs, specs, strict=True):
                got.setdefault(c, {})[phase] = json.loads(Path(f"{s}.report.json").read_text())
    return got


def table(config: str, reps: dict[str, dict]) -> str:
    lines = [f"{config} (one GPU of {reps['fresh']['gpu_bytes'] / GiB:.1f} GiB; KV cache "
             f"{reps['fresh']['kv_tokens']} tokens at launch, plan "
             f"{reps['fresh']['plan_kv_tokens']})", "",
             "| moment | peak GiB | plan GiB | off |", "|---|---:|---:|---:|"]
    seen = set()
    for phase in ("fresh", "resume"):
        for r in reps[phase]["moments"]:
            if r["moment"] in seen:
                continue
            seen.add(r["moment"])
            off = "" if r["off"] is None else f"{100 * r['off']:+.1f}%"
            plan = "" if not r["plan_bytes"] else f"{r['plan_bytes'] / GiB:.2f}"
            lines.append(f"| {r['moment']} | {r['peak_bytes'] / GiB:.2f} | {plan} | {off} |")
    problems = reps["fresh"]["problems"] + reps["resume"]["problems"]
    lines += [""] + [f"- {p}" for p in problems] if problems else ["", "no problem"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write every report to this file")
    ap.add_argument("--configs", nargs="*", default=sorted(CONFIGS), choices=sorted(CONFIGS))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ledger-") as tmp:
        got = reports(args.configs, Path(tmp))
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    for c in args.configs:
        print(table(c, got[c]), end="\n\n")
    bad = any(got[c][p]["problems"] for c in got for p in got[c])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
