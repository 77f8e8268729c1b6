"""Run logging: `RUN_DIR/metrics.jsonl` (one JSON object per step), tensorboard, optional
Weights & Biases, a progress bar with ETA, and an event log for decisions worth reading later
(precision fallbacks, checkpoints, resumes).

Only the rank that owns the logger writes (rank 0); other ranks get a disabled logger.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "read_metrics", "printable"]


def printable(text: str) -> str:
    """`text` safe for an operator's terminal: every control or format character (C0 and C1
    controls such as ESC, BEL and CSI; Unicode format characters such as bidi overrides) but
    newline and tab is written as its escape (\\x1b, \\u202e), so model text cannot set the
    window title, clear the screen or write the clipboard (OSC 52)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t " else _escape(c) for c in text)


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _clean(v: Any):
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        f = float(v)
        return f if math.isfinite(f) else None
    return v


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All step records of `RUN_DIR/metrics.jsonl` (a torn last line is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsLogger:
    """Writes step metrics and events.

    Args:
        run_dir: output directory.
        enabled: False on non-zero ranks (everything becomes a no-op).
        total_steps: for the progress bar's ETA.
        start_step: first step of this process (resume).
        tensorboard: write event files under RUN_DIR/tensorboard.
        wandb_project, wandb_name: log to W&B when a project is given.
        progress_bar: show a tqdm bar on stderr.
        config: resolved config dict (W&B run config).
    """

    def __init__(self, run_dir, *, enabled=True, total_steps=0, start_step=0, tensorboard=True,
                 wandb_project=None, wandb_name=None, progress_bar=True, config=None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._tb = self._wandb = self._bar = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._events = open(self.run_dir / "events.log", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=wandb_name, config=config,
                                     dir=str(self.run_dir), resume="allow")
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step",
                             dynamic_ncols=True, file=sys.stderr)

    def _truncate_after(self, start_step: int) -> None:
        """On resume, drop records of steps that the checkpoint does not include."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        keep = [r for r in read_metrics(self.run_dir) if int(r.get("step", -1)) < start_step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step (`step` is 0-based and stored as given)."""
        if not self.enabled:
            return
        row = {"step": step, "time": time.time()}
        row.update({k: _clean(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self._bar is not None:
            self._bar.update(1)
            shown = {k: row[k] for k in ("reward/mean", "loss", "clip_fraction") if
                     isinstance(row.get(k), float)}
            self._bar.set_postfix({k.split("/")[-1]: f"{v:.4g}" for k, v in shown.items()})

    def event(self, text: str) -> None:
        """A line for humans: printed and appended to RUN_DIR/events.log."""
        if not self.enabled:
            return
        line = f"[{time.strftime('%H:%M:%S')}] {printable(text)}"
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)
        self._events.write(line + "\n")

    def close(self) -> None:
        if not self.enabled:
            return
        for h in (self._bar, self._tb):
            if h is not None:
                h.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._file.close()
        self._events.close()
        self.enabled = False
