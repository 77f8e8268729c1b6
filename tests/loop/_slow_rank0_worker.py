"""`megatron-gspo train` (the CLI) with rank 0's rollout and evaluation each made
SLOW_RANK0_S seconds slower; run it under torchrun with several ranks."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_gspo import cli, phases  # noqa: E402

DELAY = float(os.environ.get("SLOW_RANK0_S", "0"))


def _slow(fn):
    def slow(*args, **kwargs):
        time.sleep(DELAY)
        return fn(*args, **kwargs)

    return slow


phases.rollout = _slow(phases.rollout)  # rank 0 only (train.py calls it there)
phases.evaluate = _slow(phases.evaluate)

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
