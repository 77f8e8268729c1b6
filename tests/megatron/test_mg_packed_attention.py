"""The local spec's packed attention: per-length segment batches equal Megatron-Core's
block-masked attention and an unpacked float64 reference (values and gradients, GQA) whether
the row holds one length, lengths in order or in any order, and a sequence's result does not
depend on what else is packed in its row."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_segment_attention_matches_block_mask_and_reference():
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_attention_worker.py"))],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert res["shape"] == [30, 1, 32]
    assert res["vs_reference"] < 1e-12
    assert res["vs_fallback"] < 1e-12
    assert res["grad_vs_fallback"] < 1e-12
    assert res["invariant"]
    for layout, diff in res["layouts"].items():  # values and gradients, every segment layout
        assert diff < (1e-12 if layout.endswith("float64") else 1e-5), (layout, diff)
    assert len(res["layouts"]) == 6
