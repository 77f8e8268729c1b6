"""Per-episode metrics of the episode runner: numeric `info` summed over turns, and the batch
means that go to the log (`agent/*`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_gspo.data.sample import Sample


def merge_info(metrics: dict[str, Any], info: dict[str, Any]) -> None:
    """Sum numeric info into the episode metrics; keep the last value of anything else."""
    for k, v in info.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            metrics[k] = metrics.get(k, 0) + v
        else:
            metrics[k] = v


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Batch means of the numeric episode metrics (and of the reward), for logging.

    Tool-error counts are reported as totals per episode (mean over episodes); stop reasons as
    shares (`stop/<reason>`).
    """
    out: dict[str, float] = {}
    n = max(len(samples), 1)
    keys: set[str] = set()
    for s in samples:
        keys |= {
            k
            for k, v in s.metadata.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    for k in sorted(keys):
        out[f"agent/{k}"] = sum(float(s.metadata.get(k, 0)) for s in samples) / n
    for s in samples:
        key = f"agent/stop/{s.metadata.get('stop_reason', 'unknown')}"
        out[key] = out.get(key, 0.0) + 1.0 / n
    out["agent/reward"] = sum(float(s.reward or 0.0) for s in samples) / n
    return out
