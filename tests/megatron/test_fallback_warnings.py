"""Megatron-Core's import-time warnings about a missing Transformer Engine / apex (half a screen
on a CPU run) become one line naming the fallbacks in use: none of the raw warnings reach
stderr, while other warnings still do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAW = ("Transformer Engine and Apex are not installed", "Apex is not installed",
       "full scope is deprecated")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return dict(env, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))


def _has_te_or_apex() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("transformer_engine", "apex"))


def test_learner_imports_print_no_raw_warnings_and_summary_names_fallbacks():
    code = """
import warnings
import megatron_gspo.megatron.learner  # noqa: F401
import megatron.core.optimizer, megatron.core.optimizer.clip_grads  # noqa: E401,F401
import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
from megatron_gspo.megatron.fallbacks import fallback_summary
warnings.warn("an unrelated warning still shows")
print(fallback_summary())
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for raw in RAW:
        assert raw not in out.stderr, out.stderr
    assert "an unrelated warning still shows" in out.stderr
    line = out.stdout.strip().splitlines()[-1]
    if not _has_te_or_apex():
        assert line.startswith("Megatron-Core fallbacks (no Transformer Engine, no apex): ")
        for part in ("torch optimizers", "local multi-tensor", "torch norms", "local layer"):
            assert part in line, line


@pytest.mark.slow
def test_cpu_train_run_stderr_has_one_fallback_line_and_no_raw_warnings(tmp_path):
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train",
           str(ROOT / "examples" / "tiny" / "config.yaml"), "--run-dir", str(tmp_path / "r"),
           "train.max_steps=1", "train.prompts_per_step=2", "rollout.group_size=2",
           "rollout.max_new_tokens=4", "train.eval_interval=0", "logging.progress_bar=false",
           "logging.tensorboard=false", "logging.log_samples=0", "checkpoint.interval=0"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for raw in RAW:
        assert raw not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "Megatron-Core fallbacks" in ln]
    assert len(lines) == 1, out.stderr
    assert "UserWarning" not in out.stderr, out.stderr
    assert lines[0] in (tmp_path / "r" / "events.log").read_text()
