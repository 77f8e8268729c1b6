"""Multi-turn samples inside the Megatron learner (own process, CPU/gloo): GSPO-token with
episode-level advantages equals GSPO; environment tokens receive no gradient."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_learner_multiturn_checks(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT),
               PYTHONWARNINGS="ignore", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_learner_worker.py")), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == [], report
    assert report["info"]["grad_change_from_model_token_advantage"] > 0
