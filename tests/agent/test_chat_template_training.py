"""The multi-turn example trains through its tokenizer's chat template with the same numbers as
with the built-in renderer (two short `megatron-gspo train` runs, metrics compared)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "multiturn_agent" / "config_cpu.yaml"


def _train(run: Path, mode: str) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir",
           str(run), "train.max_steps=2", "train.prompts_per_step=4", "rollout.group_size=4",
           "train.eval_interval=0", "logging.tensorboard=false", "checkpoint.interval=0",
           "logging.progress_bar=false", f"agent.chat_template={mode}"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_example_trains_the_same_through_the_template(tmp_path):
    tmpl = _train(tmp_path / "template", "tokenizer")
    builtin = _train(tmp_path / "builtin", "builtin")
    assert len(tmpl) == len(builtin) == 2
    for a, b in zip(tmpl, builtin, strict=True):
        keys = [k for k in a if "time" not in k and k != "tokens_per_s"]
        assert {"loss", "tokens", "trainable_tokens", "reward/mean", "agent/tool_calls",
                "agent/env_tokens", "grad_norm"} <= set(keys)
        assert {k: a[k] for k in keys} == {k: b.get(k) for k in keys}
