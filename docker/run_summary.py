"""Summary and checks of a finished run directory (the docker tier reads its runs with it):

    python3 docker/run_summary.py RUN_DIR --steps N [--world W] [--checkpoint S] [--resumed-at K]

Prints one line per metrics row (step, reward, loss, grad norm, clip fraction, step time) and
checks: the metrics hold steps 0..N-1 once each with finite loss and reward; with --checkpoint
the newest complete checkpoint is step S, written by W ranks (its COMPLETE marker); with
--resumed-at the run's events.log says it resumed at step K (a fresh job continuing the run).
Exit code 1, with one line per failed check.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

COLUMNS = (("step", "step"), ("reward/mean", "reward"), ("loss", "loss"),
           ("grad_norm", "grad_norm"), ("clip_fraction", "clip_frac"), ("time/step", "step_s"))


def rows_of(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]


def table(rows: list[dict]) -> str:
    out = ["  ".join(f"{h:>10}" for _, h in COLUMNS)]
    for r in rows:
        cells = []
        for key, _ in COLUMNS:
            v = r.get(key)
            cells.append(f"{v:>10}" if isinstance(v, int) or v is None else f"{v:>10.4f}")
        out.append("  ".join(cells))
    return "\n".join(out)


def check(run: Path, steps: int, world: int | None, checkpoint: int | None,
          resumed_at: int | None) -> list[str]:
    """The failed checks (empty: all passed)."""
    problems = []
    rows = rows_of(run)
    got = [r["step"] for r in rows]
    if got != list(range(steps)):
        problems.append(f"metrics steps {got}, expected 0..{steps - 1} once each")
    bad = [r["step"] for r in rows
           if not all(math.isfinite(float(r.get(k, math.nan))) for k in ("loss", "reward/mean"))]
    if bad:
        problems.append(f"loss or reward/mean missing or not finite at steps {bad}")
    if checkpoint is not None:
        done = sorted(p for p in (run / "checkpoints").glob("step_*") if (p / "COMPLETE").is_file())
        if not done:
            problems.append("no complete checkpoint")
        else:
            marker = json.loads((done[-1] / "COMPLETE").read_text())
            if marker["step"] != checkpoint:
                problems.append(f"newest checkpoint is step {marker['step']}, "
                                f"expected {checkpoint}")
            if world is not None and marker["world_size"] != world:
                problems.append(f"checkpoint written by {marker['world_size']} ranks, "
                                f"not {world}")
            print(f"newest checkpoint: {done[-1].name} (world_size {marker['world_size']}, "
                  f"{len(marker['files'])} files)")
    if resumed_at is not None:
        events = (run / "events.log").read_text()
        hits = re.findall(r"resumed from \S+ at step (\d+)", events)
        print(f"events.log resumes: {hits}")
        if str(resumed_at) not in hits:
            problems.append(f"events.log does not say the run resumed at step {resumed_at}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--checkpoint", type=int, default=None)
    ap.add_argument("--resumed-at", type=int, default=None)
    args = ap.parse_args(argv)
    print(f"{args.run_dir}/metrics.jsonl:")
    print(table(rows_of(args.run_dir)))
    problems = check(args.run_dir, args.steps, args.world, args.checkpoint, args.resumed_at)
    for p in problems:
        print(f"run_summary: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
