"""The precision sweep's figure (bench/precision_sweep.py): share out of the clip range against
response length per engine/learner dtype pair, with the 1/sqrt(L) expectation drawn in."""

from __future__ import annotations

import math
from pathlib import Path


def plot(result: dict, path: Path) -> None:
    """Three panels: sequences out of GSPO's range (measured, and expected from the per-token
    spread with d_i's deviation shrinking as 1/sqrt(L)); tokens out of GRPO's range; the
    standard deviation of d_i with sigma_token / sqrt(L)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts, summ = result["points"], result["summary"]
    tol = result["settings"]["tolerance"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, pair in enumerate(summ):
        c = colors[i % len(colors)]
        rows = sorted((p for p in pts if p["pair"] == pair), key=lambda p: p["length"])
        lengths = [p["length"] for p in rows]
        axes[0].plot(lengths, [p["gspo_seq_out"] for p in rows], "o-", color=c, label=pair)
        axes[0].plot(lengths, [p["expected_gspo_seq_out"] for p in rows], "--", color=c,
                     alpha=0.7)
        axes[1].plot(lengths, [max(p["grpo_token_out"], 1e-5) for p in rows], "o-", color=c,
                     label=pair)
        axes[2].plot(lengths, [max(p["seq_mismatch_std"], 1e-9) for p in rows], "o-", color=c,
                     label=pair)
        sigma = summ[pair]["token_diff_std"]
        if sigma > 0:
            axes[2].plot(lengths, [sigma / math.sqrt(L) for L in lengths], "--", color=c,
                         alpha=0.7)
    axes[0].axhline(tol, color="gray", lw=0.8, ls=":")
    axes[0].text(lengths[0], tol, f" auto's tolerance {tol}", va="bottom", fontsize=8)
    lo, hi = result["settings"]["gspo_clip"]
    axes[0].set_title(f"sequences out of GSPO's clip range ({lo:g}/{hi:g})\n"
                      "solid: measured; dashed: expected, std(d_i) = sigma_token/sqrt(L)")
    axes[0].set_ylabel("share of sequences")
    glo, ghi = result["settings"]["grpo_clip"]
    axes[1].set_title(f"tokens out of GRPO's clip range ({glo:g}/{ghi:g})\n(1e-5 = none)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("share of tokens")
    axes[2].set_title("std of d_i = mean_t(logp_learner - logp_engine)\n"
                      "dashed: sigma_token / sqrt(L)")
    axes[2].set_yscale("log")
    axes[2].set_ylabel("std of d_i")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("response length L (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="engine/learner", title_fontsize=8)
    s = result["settings"]
    fig.suptitle(f"{s['model']}: {s['prompts']} prompts x {s['group']} responses per point, "
                 f"seed {s['seed']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
