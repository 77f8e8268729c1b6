"""The report of an A/B study (`megatron_gspo.study`): per-arm numbers from each arm's
`metrics.jsonl` (summary.json) and one PNG with a panel per quantity and the arms overlaid.

Every number in `arms.<name>.metrics` is computed from logged training metrics only, so a rerun
of a seeded study repeats it exactly; wall times live apart, in `arms.<name>.wall_time_s`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_gspo.runtime.metrics import read_metrics

__all__ = ["summarize", "plot_study", "PANELS"]

# (title, metric keys or key substrings ("~..."), log-scale y)
PANELS = [
    ("reward (train: solid, eval: dashed)", ["reward/mean", "eval/reward_mean"], False),
    ("clip fraction (all mini-batches)", ["clip_fraction"], True),
    ("clip fraction, first mini-batch (engine/learner mismatch)",
     ["clip_fraction/first_minibatch"], True),
    ("clip fraction, later mini-batches (+ policy drift)",
     ["clip_fraction/later_minibatches"], True),
    ("expert-change rate per optimizer step", ["~expert_change"], False),
    ("routing agreement, learner vs engine (mean over layers)", ["moe/routing_agreement/mean"],
     False),
    ("grad norm (before clipping)", ["grad_norm"], True),
    ("ratio spread, max - min (GSPO: sequence, GRPO: token)", ["ratio/spread"], True),
]
_MEANS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high",
          "clip_fraction/first_minibatch", "clip_fraction/later_minibatches", "grad_norm",
          "ratio/spread", "ratio_mean", "response_length/mean", "precision/out_of_range_fraction",
          "precision/seq_abs_mismatch_mean", "entropy", "update_skipped",
          # masked shares by cause (GSPO-family corrections, DAPO overlong options)
          "precision/masked_share/mask", "precision/masked_share/mis",
          "precision/masked_share/icepop", "precision/tis_truncated_share",
          "offpolicy_masked_share", "reward/overlong_filtered_share",
          "reward/overlong_penalty_mean")
_MOE_HINTS = ("moe/", "expert_change", "routing_agreement", "routing/", "router")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if _num(r.get(key))]


def _mean(vals: list[float]) -> float | None:
    return sum(vals) / len(vals) if vals else None


def arm_numbers(rows: list[dict]) -> dict:
    """Deterministic per-arm numbers from its metric rows (one per step).

    Returns:
        steps; reward/first, reward/final (mean over the last tenth of the steps, >= 1 step),
        reward/mean; eval/reward_first, eval/reward_final, eval/reward_best; `<key>/mean` of the
        clip fractions (all, split by cause), grad norm, ratio spread and every MoE routing
        metric logged; ratio_min/min and ratio_max/max.
    """
    out: dict = {"steps": len(rows)}
    rew = [v for _, v in _series(rows, "reward/mean")]
    if rew:
        tail = rew[-max(1, math.ceil(len(rew) / 10)):]
        out.update({"reward/first": rew[0], "reward/final": _mean(tail),
                    "reward/mean": _mean(rew)})
    ev = _series(rows, "eval/reward_mean")
    if ev:
        out.update({"eval/reward_first": ev[0][1], "eval/reward_final": ev[-1][1],
                    "eval/reward_best": max(v for _, v in ev), "eval/steps": [s for s, _ in ev]})
    keys = list(_MEANS) + sorted({k for r in rows for k in r
                                  if any(h in k for h in _MOE_HINTS) and _num(r[k])})
    for key in keys:
        m = _mean([v for _, v in _series(rows, key)])
        if m is not None:
            out[f"{key}/mean"] = m
    lo = [v for _, v in _series(rows, "ratio_min")]
    hi = [v for _, v in _series(rows, "ratio_max")]
    if lo and hi:
        out["ratio_min/min"], out["ratio_max/max"] = min(lo), max(hi)
    return out


def summarize(out_dir: Path, arms: list[str], description: str = "",
              overrides: dict | None = None) -> dict:
    """summary.json's content: per arm its overrides, deterministic `metrics` and wall time.

    Args:
        out_dir: the study directory (one run directory per arm).
        arms: arm names in study order.
    """
    res: dict = {"description": description, "arms": {}}
    for name in arms:
        arm_dir = out_dir / name
        state = {}
        if (arm_dir / "study_arm.json").exists():
            state = json.loads((arm_dir / "study_arm.json").read_text())
        rows = read_metrics(arm_dir)
        attempts = state.get("attempts", [])
        res["arms"][name] = {
            "overrides": (overrides or {}).get(name, state.get("overrides")),
            "status": state.get("status", "not started"),
            "metrics": arm_numbers(rows),
            "wall_time_s": round(sum(a.get("wall_s", 0.0) for a in attempts), 1),
            "train_time_s": round(sum(float(r.get("time/step") or 0.0) for r in rows), 1),
            "attempts": len(attempts),
        }
    return res


def _keys_for(rows: list[dict], spec: list[str]) -> list[str]:
    keys = []
    for k in spec:
        if k.startswith("~"):
            keys += sorted({x for r in rows for x in r if k[1:] in x and _num(r[x])})
        else:
            keys.append(k)
    return keys


def plot_study(out_dir: Path, arms: list[str], path: Path | None = None) -> Path:
    """One PNG (DIR/study.png): a panel per quantity of `PANELS`, one colour per arm; a panel
    no arm logged says so.

    Returns:
        the PNG path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = path or out_dir / "study.png"
    runs = {a: read_metrics(out_dir / a) for a in arms}
    fig, axes = plt.subplots(2, 4, figsize=(18, 8), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, spec, log_y) in zip(axes.flat, PANELS, strict=True):
        drawn, positive = 0, []
        for i, (arm, rows) in enumerate(runs.items()):
            for j, key in enumerate(_keys_for(rows, spec)):
                pts = _series(rows, key)
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                label = arm if j == 0 else None  # later keys: line style, named in the title
                ax.plot(xs, ys, color=colors[i % len(colors)], linestyle=["-", "--", ":"][j % 3],
                        marker="." if len(pts) < 40 else None, label=label)
                positive += [y for y in ys if y > 0]
                drawn += 1
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        if drawn:
            ax.legend(fontsize=7)
            if log_y and positive:
                ax.set_yscale("symlog", linthresh=10.0 ** math.floor(math.log10(min(positive))))
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"study {out_dir.name}: " + ", ".join(arms))
    fig.savefig(path, dpi=64)
    plt.close(fig)
    from PIL import Image  # a matplotlib dependency; 256 colours keep the file small

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=256)
    small.save(path, optimize=True)
    return path
