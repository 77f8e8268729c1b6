"""Plot a run's curves: reward, clip fraction, engine/learner mismatch, step time, MoE routing.

    python tools/plot_metrics.py RUN_DIR [--out RUN_DIR/metrics.png]

Reads RUN_DIR/metrics.jsonl (one JSON object per step) and writes one PNG with four panels
(a fifth, MoE routing, when the run logged `moe/*` metrics).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PANELS = [
    ("reward", ["reward/mean", "eval/reward_mean"]),
    ("clip fraction", ["clip_fraction", "clip_fraction_low", "clip_fraction_high",
                       "clip_fraction/first_minibatch", "clip_fraction/later_minibatches"]),
    ("engine vs learner mismatch", ["precision/seq_abs_mismatch_mean",
                                    "precision/out_of_range_fraction",
                                    "precision/token_abs_diff_mean"]),
    ("step time (s)", ["time/step", "time/rollout", "time/train"]),
]
# drawn when the run logged MoE routing metrics
MOE_PANEL = ("MoE routing", ["moe/routing_agreement/mean", "moe/routing_agreement/min",
                             "moe/expert_change_rate", "moe/routers_replayed_share"])


def plot(run_dir: Path, out: Path) -> Path:
    """Write the PNG; returns its path. Raises SystemExit with a one-line message on bad input."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_gspo.runtime.metrics import read_metrics

    rows = read_metrics(run_dir)
    if not rows:
        raise SystemExit(f"plot_metrics: no metrics in {run_dir / 'metrics.jsonl'}")
    panels = list(PANELS)
    if any(k.startswith("moe/") for r in rows for k in r):
        panels.append(MOE_PANEL)
    nrows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(nrows, 2, figsize=(11, 3.5 * nrows), constrained_layout=True)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        drawn, values = 0, []
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="." if len(pts) < 50 else None, label=k)
                values += [abs(y) for y in ys if y]
                drawn += 1
        ax.set_title(title)
        ax.set_xlabel("step")
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        if title.startswith("engine") and values:  # mismatch spans decades (fp32 ~1e-7, bf16 ~1e-2)
            ax.set_yscale("symlog", linthresh=10.0 ** math.floor(math.log10(min(values))))
    fig.suptitle(str(run_dir))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="PNG path (default RUN_DIR/metrics.png)")
    args = ap.parse_args(argv)
    if not args.run_dir.is_dir():
        raise SystemExit(f"plot_metrics: {args.run_dir} is not a directory")
    out = plot(args.run_dir, args.out or args.run_dir / "metrics.png")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
