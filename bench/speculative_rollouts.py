"""Speculative rollouts on CPU (issue 58 item 5): rollout tokens/s of the embedded engine with and
without MTP drafting, and the acceptance, as the MTP head trains in the RL loop.

1. The real loop trains the tiny demo (examples/tiny, Qwen3, 4 layers) with an added MTP layer
   trained online and drafting on at every step:
     megatron-gspo train examples/tiny/config.yaml model.mtp_layers=add
       algorithm.mtp_loss_weight=1 rollout.speculative.algorithm=mtp
       rollout.speculative.adaptive=false checkpoint.interval=EVERY ...
   Its metrics give, per step, the acceptance of the rollouts' drafts and the head's agreement
   with the sampled tokens (mtp/accuracy).
2. Every EVERY steps the run checkpoint is exported to HF (convert mcore-to-hf: the MTP layer
   included) and the embedded engine generates the same prompts twice on those weights, plain
   and drafting (K = --draft-steps), NEW tokens per row (--new-tokens, past the demo's 8: the
   stop token is ignored for the timing), at each batch size of --batches; tokens/s by wall
   time and by this process's CPU time (one thread: the CPU-time rate is the comparable one on
   a shared, loaded machine; best of 3 repetitions).

Prints the per-step table, the machine's load (`uptime`) before and after, and last
`ratio=<drafting / plain tokens/s, CPU time, batch 1, last checkpoint>`.

What the CPU can show: a 4-layer, 128-wide model is bound by per-forward overhead, so one
verification of K+1 tokens costs about one plain step, but the draft layer costs about a
quarter of the target per call and K calls are made per verification; the speed-up is
(1 + a + ... + a^K) / (1 + ~K/4 + sampling overhead), which stays far below the 1.5x target at
the acceptance a tiny head reaches. On a GPU with a large target the draft is ~1/60 of the
target and verification is memory-bound: that figure needs a GPU (docs/speculative.md).

Usage: python bench/speculative_rollouts.py [--steps 30] [--every 10] [--new-tokens 48]
       [--batches 1,16] [--draft-steps 2] [--out /tmp/spec_bench] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "megatron_gspo.cli"]


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def train(out: Path, steps: int, every: int, draft_steps: int) -> Path:
    """Run the RL loop (phase 1); returns its run directory."""
    d = ROOT / "examples" / "tiny"
    args = [f"model.path={d / 'base'}", f"data.train_path={d / 'data' / 'train.jsonl'}",
            f"data.eval_path={d / 'data' / 'eval.jsonl'}", "model.mtp_layers=add",
            "algorithm.mtp_loss_weight=1", "rollout.speculative.algorithm=mtp",
            f"rollout.speculative.num_steps={draft_steps}", "rollout.speculative.adaptive=false",
            f"train.max_steps={steps}", "train.eval_interval=0", f"checkpoint.interval={every}",
            f"checkpoint.keep_last={steps // every + 1}", "logging.progress_bar=false",
            "logging.tensorboard=false"]
    out.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(CLI + ["train", str(d / "config.yaml"), *args], cwd=out,
                       capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"the training run failed:\n{p.stderr[-3000:]}")
    return out / "runs" / "tiny-config"


def export(ckpt: Path, dst: Path) -> Path:
    """convert mcore-to-hf of one run checkpoint (the MTP layer included)."""
    if not (dst / "config.json").exists():
        p = subprocess.run(CLI + ["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out",
                                  str(dst), "--no-progress", "--force"],
                           capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"mcore-to-hf {ckpt} failed:\n{p.stderr[-2000:]}")
    return dst


def prompts(path: Path, n: int) -> list[list[int]]:
    """The demo's eval prompts as chat-rendered token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rows = [json.loads(x) for x in (ROOT / "examples/tiny/data/eval.jsonl").open()][:n]
    return [list(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False))
            for r in rows]


def timed(path: Path, draft_steps: int, batch: list[list[int]], new_tokens: int,
          reps: int = 3) -> dict:
    """Generate `batch` once (warm-up), then `reps` times; the best rate by CPU time (and its
    wall-time rate): the least disturbed repetition on a shared machine."""
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
    from megatron_gspo.rollout.speculative_control import DraftControl

    kw = {"draft_steps": draft_steps, "draft_control": DraftControl(adaptive=False)} \
        if draft_steps else {}
    eng = EmbeddedEngine(str(path), seed=0, max_batch_samples=len(batch), **kw)
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [GenerateRequest(prompt_ids=p, sampling=sp) for p in batch]
    eng.generate(reqs[:1])
    eng.speculative_metrics()
    best = None
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        out = eng.generate(reqs)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        n = sum(len(s.response_ids) for s in out)
        if best is None or n / cpu > best["cpu_tps"]:
            best = {"tokens": n, "wall_tps": n / wall, "cpu_tps": n / cpu}
    m = eng.speculative_metrics()  # over the repetitions
    return {**best, "acceptance": m.get("speculative/acceptance", float("nan")),
            "tokens_per_verify": m.get("speculative/tokens_per_verify", float("nan"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--draft-steps", type=int, default=2)
    ap.add_argument("--out", default="/tmp/spec_bench")
    ap.add_argument("--reuse", action="store_true", help="reuse an earlier run under --out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(a.out)
    load0 = _uptime()
    run = out / "runs" / "tiny-config"
    if not (a.reuse and (run / "metrics.jsonl").exists()):
        t0 = time.perf_counter()
        run = train(out, a.steps, a.every, a.draft_steps)
        print(f"training run: {a.steps} steps in {time.perf_counter() - t0:.0f} s ({run})")
    rows = {int(r["step"]): r for r in map(json.loads, (run / "metrics.jsonl").open())}
    print("\nthe loop's rollouts (batch 128 rows, 8 new tokens, drafting on, K="
          f"{a.draft_steps}):")
    print(f"{'step':>4} {'acceptance':>10} {'tok/verify':>10} {'mtp/accuracy':>12} "
          f"{'mtp/loss':>8} {'reward':>6}")
    for s, r in sorted(rows.items()):
        print(f"{s:>4} {r.get('speculative/acceptance', float('nan')):>10.3f} "
              f"{r.get('speculative/tokens_per_verify', float('nan')):>10.2f} "
              f"{r.get('mtp/accuracy', float('nan')):>12.3f} {r.get('mtp/loss', 0):>8.3f} "
              f"{r.get('reward/mean', 0):>6.2f}")
    batches = [int(b) for b in a.batches.split(",")]
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    print(f"\nembedded engine on each checkpoint's weights: {a.new_tokens} new tokens per row, "
          f"temperature 1, K={a.draft_steps}, one thread; tok/s by CPU time (wall)")
    print(f"{'step':>4} {'batch':>5} {'plain tok/s':>16} {'drafting tok/s':>16} "
          f"{'speed-up':>8} {'acceptance':>10} {'tok/verify':>10}")
    ratio = float("nan")
    for ck in ckpts:
        step = int(ck.name.split("_")[1])
        hf = export(ck, out / f"hf_{ck.name}")
        ids = prompts(hf, max(batches))
        for b in batches:
            plain = timed(hf, 0, ids[:b], a.new_tokens)
            spec = timed(hf, a.draft_steps, ids[:b], a.new_tokens)
            up = spec["cpu_tps"] / plain["cpu_tps"]
            if b == 1:
                ratio = up
            print(f"{step:>4} {b:>5} {plain['cpu_tps']:>8.0f} ({plain['wall_tps']:>5.0f}) "
                  f"{spec['cpu_tps']:>8.0f} ({spec['wall_tps']:>5.0f}) {up:>8.2f} "
                  f"{spec['acceptance']:>10.3f} {spec['tokens_per_verify']:>10.2f}", flush=True)
    print(f"\nload before: {load0}\nload after:  {_uptime()}")
    print("CPU: the tiny model is overhead-bound (a forward of K+1 tokens costs about one of 1;"
          " the draft layer ~1/4 of the target per call, K calls per verification), so the "
          "speed-up is bounded by (1 + a + ... + a^K) / (1 + ~K/4); the issue's >= 1.5x needs "
          "a large target whose draft is ~1/60 of it (a GPU figure, not measured here)")
    print(f"ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
