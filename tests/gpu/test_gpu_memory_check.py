"""scripts/gpu_memory_check.py on the CPU (tiny shape, storage bytes for allocated memory):
resident bytes equal the plan, offload leaves nothing, onload restores the same bytes and
log-probs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_memory_check_cpu_path(tmp_path):
    out = tmp_path / "mem.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_memory_check.py"),
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES="",
                                             OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["failures"] == [] and res["model"] == "tiny"
    assert res["resident_bytes"] == res["plan_bytes"] == res["allocated_after_onload"]
    assert res["allocated_after_offload"] == 0 and res["logprobs_equal"]
