"""tools/gpu_selfcheck.py on a GPU machine with the image's stack: every GPU row passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_selfcheck_passes(tmp_path):
    pytest.importorskip("transformer_engine", reason="Transformer Engine not installed")
    pytest.importorskip("apex", reason="apex not installed")
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_selfcheck.py"), "--json",
                        str(out), "--timeout", "300"], check=False, capture_output=True,
                       text=True, timeout=1200, cwd=ROOT)
    print(r.stdout)
    rows = {row["check"]: row for row in json.loads(out.read_text())["rows"]}
    for name in ("cuda devices", "nccl all-reduce", "transformer-engine", "apex",
                 "megatron-core", "TE-spec GPTModel fwd/bwd"):
        assert rows[name]["status"] == "ok", rows[name]
    assert r.returncode == 0, r.stdout + r.stderr
