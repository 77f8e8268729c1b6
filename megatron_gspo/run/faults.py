"""Fault injection for crash tests, off unless `MEGATRON_GSPO_FAULT` is set.

The variable holds comma-separated `point@step` items, e.g. `kill_before_complete@3,nan_loss@2`:
- `kill_before_rename@S`: SIGKILL after every rank wrote checkpoint S, before it is renamed;
- `kill_before_complete@S`: SIGKILL after the rename, before the COMPLETE marker is written;
- `nan_loss@S`: the advantages of RL step S are NaN (a non-finite loss and gradients).
Only the process whose environment has the variable is affected.
"""

from __future__ import annotations

import os
import signal

ENV = "MEGATRON_GSPO_FAULT"


def active(point: str, step: int) -> bool:
    """True when `point@step` is listed in MEGATRON_GSPO_FAULT."""
    spec = os.environ.get(ENV, "")
    return f"{point}@{step}" in {s.strip() for s in spec.split(",") if s.strip()}


def maybe_kill(point: str, step: int) -> None:
    """SIGKILL this process when `point@step` is listed."""
    if active(point, step):
        os.kill(os.getpid(), signal.SIGKILL)
