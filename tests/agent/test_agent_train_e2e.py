"""The multi-turn example runs end to end through `megatron-gspo train` (short version):
episodes with calculator calls, turn-level GSPO-token advantages, the Megatron learner."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "multiturn_agent" / "config_cpu.yaml"


def test_agent_example_trains_two_steps(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir",
           str(run), "train.max_steps=2", "train.prompts_per_step=4", "rollout.group_size=4",
           "train.eval_interval=0", "logging.tensorboard=false", "checkpoint.interval=0",
           "logging.progress_bar=false", "precision.audit_fraction=1.0"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/samples"] == 16
        assert any(k.startswith("agent/") for k in r)
        # engine log-probs of model tokens agree with the learner (environment tokens masked)
        assert r["precision/token_abs_diff_max"] < 1e-4
        assert r["precision/out_of_range_fraction"] == 0.0
        assert r["trainable_tokens"] < r["tokens"]  # environment and prompt tokens excluded
        assert r["loss"] == r["loss"]  # finite
    assert rows[1]["rollout/weight_version"] == 1.0
