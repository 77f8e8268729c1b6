"""GPU learner checks (skipped without CUDA): NCCL + local spec against the CPU reference,
TE spec when installed, the 4-rank layouts when 4 GPUs are visible."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_learner_check(tmp_path):
    # A torch too old for the CPU layer uses the reference scripts/gpu_wheels.sh made.
    ref = ROOT / ".whl" / "learner_ref" / "ref.pt"
    extra = ["--reference", str(ref)] if ref.is_file() else []
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_learner_check.py"),
                        "--out", str(tmp_path), *extra], cwd=ROOT, capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
