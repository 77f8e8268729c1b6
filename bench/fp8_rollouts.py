"""FP8 rollouts study (docs/results/fp8-rollouts.md): BF16 vs block-FP8 (W8A16) embedded engine
on the tiny dense model and the tiny MoE, with and without the precision module's corrections,
over seeds; one command runs every study (a finished arm is not rerun) and writes the page's
summary json and plot.

    python bench/fp8_rollouts.py [--seeds 1 2 3] [--models dense moe] [--out runs]
                                 [--summary-only]

Each (model, seed) is `megatron-gspo study examples/study/fp8_<model>.yaml --out
runs/study-fp8_<model>-seed<S> train.seed=<S>`; the models run side by side (one study each,
one torch thread per trainer), seeds one after the other. A study that has not finished by the
time the summary is written is summarised over the seeds that have.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("bf16", "fp8", "fp8_tis", "fp8_mask", "fp8_mask_wide", "fp32", "fp8_fp32",
        "grpo_bf16", "grpo_fp8")
BINS = 4
MISMATCH = ("precision/seq_abs_mismatch_mean", "precision/token_abs_diff_mean",
            "precision/out_of_range_fraction", "precision/k3_kl",
            "precision/seq_abs_mismatch_max")
MEANS = MISMATCH + ("moe/routing_agreement/mean", "moe/expert_change_rate",
                    "precision/masked_share/mask", "precision/tis_weight_mean",
                    "precision/tis_truncated_share", "clip_fraction", "grad_norm",
                    "weight_sync/fp8_tensors", "time/step", "time/weight_sync",
                    "time/old_logprobs",
                    "response_length/mean")


def study_dir(out: Path, model: str, seed: int) -> Path:
    return out / f"study-fp8_{model}-seed{seed}"


def run_model(model: str, seeds: list[int], out: Path) -> None:
    from megatron_gspo.study.arms import run_study

    for seed in seeds:
        try:
            run_study(ROOT / "examples" / "study" / f"fp8_{model}.yaml",
                      study_dir(out, model, seed), overrides=[f"train.seed={seed}"],
                      log=lambda line, m=model, s=seed: print(f"[{m} seed {s}] {line}",
                                                              file=sys.stderr, flush=True))
        except Exception as e:  # noqa: BLE001 - the other seeds still run; the summary says
            print(f"[{model} seed {seed}] failed: {e}", file=sys.stderr, flush=True)


def _rows(arm_dir: Path) -> list[dict]:
    f = arm_dir / "metrics.jsonl"
    if not f.is_file():
        return []
    by_step: dict[int, dict] = {}
    for line in f.read_text().splitlines():
        r = json.loads(line)
        by_step.setdefault(int(r["step"]), {}).update(r)  # the last write of a step wins
    return [by_step[s] for s in sorted(by_step)]


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _sd(xs):
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def arm_run(rows: list[dict], state: dict) -> dict:
    """One (model, seed, arm) run's numbers."""
    rew = [r["reward/mean"] for r in rows if _num(r.get("reward/mean"))]
    half = len(rew) // 2
    ev = [r["eval/reward_mean"] for r in rows if _num(r.get("eval/reward_mean"))]
    out = {"steps": len(rows), "reward_curve": rew,
           "reward/first_half": _mean(rew[:half]), "reward/second_half": _mean(rew[half:]),
           "reward/last5": _mean(rew[-5:]), "eval/final": ev[-1] if ev else None,
           "wall_time_s": round(sum(a.get("wall_s", 0.0) for a in state.get("attempts", [])), 1)}
    for k in MEANS:
        out[k] = _mean([r[k] for r in rows if _num(r.get(k))])
    by_len = {}
    for b in range(BINS):  # sequence-weighted over the steps
        n = [r.get(f"precision/len_bin{b}/sequences", 0.0) for r in rows]
        for stat in ("seq_abs_mismatch_mean", "token_abs_diff_mean", "out_of_range_fraction"):
            v = [(r.get(f"precision/len_bin{b}/{stat}"), w)
                 for r, w in zip(rows, n, strict=True) if w]
            tot = sum(w for _, w in v)
            by_len.setdefault(f"bin{b}", {})[stat] = (sum(x * w for x, w in v) / tot
                                                     if tot else None)
        by_len[f"bin{b}"]["sequences"] = sum(n)
    out["mismatch_by_length"] = by_len
    return out


def summarize(out: Path, models: list[str], seeds: list[int]) -> dict:
    res: dict = {"arms": list(ARMS), "length_bins": "quarters of rollout.max_new_tokens (8): "
                 "bin0 1 token, bin1 2-3, bin2 4-5, bin3 6-8 trainable tokens", "models": {}}
    for model in models:
        runs: dict = {a: {} for a in ARMS}
        for seed in seeds:
            for arm in ARMS:
                d = study_dir(out, model, seed) / arm
                st = json.loads((d / "study_arm.json").read_text()) if (
                    d / "study_arm.json").is_file() else {}
                if st.get("status") == "done":
                    runs[arm][str(seed)] = arm_run(_rows(d), st)
        agg: dict = {}
        for arm, per_seed in runs.items():
            a: dict = {"seeds": sorted(per_seed, key=int)}
            for k in ("reward/first_half", "reward/second_half", "reward/last5", "eval/final",
                      "wall_time_s", *MEANS):
                xs = [r[k] for r in per_seed.values()]
                a[k] = {"mean": _mean(xs), "sd": _sd(xs)}
            curves = [r["reward_curve"] for r in per_seed.values()]
            n = min((len(c) for c in curves), default=0)
            a["reward_curve_mean"] = [_mean([c[i] for c in curves]) for i in range(n)]
            a["mismatch_by_length"] = {
                b: {s: _mean([r["mismatch_by_length"][b][s] for r in per_seed.values()])
                    for s in ("seq_abs_mismatch_mean", "token_abs_diff_mean",
                              "out_of_range_fraction", "sequences")}
                for b in (f"bin{i}" for i in range(BINS))}
            agg[arm] = a
        res["models"][model] = {"per_seed": runs, "mean_over_seeds": agg}
    return res


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(summary["models"])
    fig, ax = plt.subplots(len(models), 2, figsize=(12, 4 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        agg = summary["models"][model]["mean_over_seeds"]
        for arm in ARMS:
            c = agg[arm]["reward_curve_mean"]
            if c:
                ax[i][0].plot(range(len(c)), c, label=f"{arm} ({len(agg[arm]['seeds'])} seeds)")
        ax[i][0].set_title(f"{model}: train reward, mean over seeds")
        ax[i][0].set_xlabel("step")
        ax[i][0].legend(fontsize=8)
        for j, arm in enumerate(("fp32", "fp8_fp32", "bf16", "fp8")):
            ml = agg[arm]["mismatch_by_length"]
            ys = [ml[f"bin{b}"]["seq_abs_mismatch_mean"] or 0.0 for b in range(BINS)]
            ax[i][1].bar([b + 0.2 * j for b in range(BINS)], ys, width=0.2,
                         label=f"{arm} engine")
        ax[i][1].set_xticks([b + 0.3 for b in range(BINS)],
                            ["1 tok", "2-3", "4-5", "6-8"])
        ax[i][1].set_title(f"{model}: mean |d_i| engine vs learner by response length")
        ax[i][1].set_yscale("log")
        ax[i][1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--models", nargs="+", default=["dense", "moe"])
    ap.add_argument("--out", default="runs")
    ap.add_argument("--summary-only", action="store_true")
    ap.add_argument("--results", default=str(ROOT / "docs" / "results" / "fp8-rollouts"))
    args = ap.parse_args()
    out = Path(args.out)
    if not args.summary_only:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the trainers inherit it
        threads = [threading.Thread(target=run_model, args=(m, args.seeds, out))
                   for m in args.models]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    summary = summarize(out, args.models, args.seeds)
    Path(args.results + ".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, Path(args.results + ".png"))
    print(f"wrote {args.results}.summary.json and .png", file=sys.stderr)


if __name__ == "__main__":
    main()
