"""A GSPO step of the real loop moves the policy the way the advantages say: the
advantage-weighted change of the batch's mean token log-probs is positive and the
negative-advantage responses become less likely (first-order improvement of the objective)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_step_follows_the_advantages():
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_improve_worker.py"))],
                         cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                         capture_output=True, text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    r = json.loads(line[0][len("RESULT "):])
    assert r["source"] == "rollout"
    assert r["weighted"] > 0
    assert r["neg"] < 0
    assert r["pos"] > r["neg"]
