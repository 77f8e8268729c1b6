"""Fault injection for crash tests, off unless `MEGATRON_GSPO_FAULT` is set.

The variable holds comma-separated `point@step` items, e.g. `kill_before_complete@3,nan_loss@2`:
- `kill_before_rename@S`: SIGKILL after every rank wrote checkpoint S, before it is renamed;
- `kill_before_complete@S`: SIGKILL after the rename, before the COMPLETE marker is written;
- `delay_publish@S`: the publish of checkpoint S (manifest, rename, COMPLETE) starts
  `DELAY_S` seconds late: an asynchronous save on a busy machine, deterministically;
- `nan_loss@S`: the advantages of RL step S are NaN (a non-finite loss and gradients);
- `kill_at_step@S`, `kill_rank<R>_at_step@S`: SIGKILL (every rank, or rank R only) when RL
  step S begins; under torchrun's restarts it fires again in every round that reaches S.
- `kill_in_sync@V`, `kill_rank<R>_in_sync@V`: SIGKILL inside the weight sync of version V (the
  sync after step V - 1), once the first bucket of the stream went to the engine.
An item ending in `#N` (`kill_rank1_in_sync@3#0`) fires only in torchrun's restart round N.
Only the process whose environment has the variable is affected.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "MEGATRON_GSPO_FAULT"
DELAY_S = 3.0  # `delay_publish`


def active(point: str, step: int) -> bool:
    """True when `point@step` is listed in MEGATRON_GSPO_FAULT."""
    spec = os.environ.get(ENV, "")
    items = {s.strip() for s in spec.split(",") if s.strip()}
    rnd = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{point}@{step}" in items or f"{point}@{step}#{rnd}" in items


def maybe_kill(point: str, step: int) -> None:
    """SIGKILL this process when `point@step` is listed."""
    if active(point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_delay(point: str, step: int) -> None:
    """Sleep DELAY_S seconds when `point@step` is listed."""
    if active(point, step):
        time.sleep(DELAY_S)


def maybe_kill_rank(point: str, step: int) -> None:
    """SIGKILL this process when `point@step` or `point` for this rank (`kill_rank1_at_step`
    for `kill_at_step` on RANK 1) is listed."""
    if not os.environ.get(ENV):
        return
    maybe_kill(point, step)
    rank = os.environ.get("RANK", "0")
    maybe_kill(point.replace("kill_", f"kill_rank{rank}_", 1), step)
