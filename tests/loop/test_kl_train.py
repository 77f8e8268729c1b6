"""KL / entropy settings through the config and the CLI loop: flags the run would ignore are
one-line config errors; a KL run logs kl/mean from ~0 upward and the reference memory; after a
kill -9 and resume the reference is rebuilt from the initial weights (kl/mean continues exactly
as in the uninterrupted run, which it would not if the reference came from the checkpoint)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_gspo.config import ConfigError, config_from_dict

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
FAST = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "algorithm.mini_batches=2", "logging.progress_bar=false", "logging.tensorboard=false",
        "train.eval_interval=0", "logging.log_samples=0", "optimizer.lr=1e-3"]


@pytest.mark.parametrize("overrides, field", [
    (["algorithm.kl_estimator=k1"], "algorithm.kl_estimator"),
    (["algorithm.kl_in=reward"], "algorithm.kl_in"),
    (["model.reference_path=/x"], "model.reference_path"),
    (["model.reference_offload=true"], "model.reference_offload"),
    (["algorithm.kl_coef=-0.1"], "algorithm.kl_coef"),
    (["algorithm.entropy_coef=-1"], "algorithm.entropy_coef"),
    (["algorithm.kl_coef=0.1", "algorithm.kl_estimator=k4"], "algorithm.kl_estimator"),
    (["algorithm.kl_coef=0.1", "algorithm.kl_in=reward", "algorithm.loss=gspo_token",
      "agent.enabled=true", "agent.advantage=turn"], "algorithm.kl_in"),
])
def test_unused_or_bad_kl_flags_are_config_errors(overrides, field):
    with pytest.raises(ConfigError, match=f"^{field}: ") as e:
        config_from_dict({}, overrides)
    assert "\n" not in str(e.value)


def test_kl_flags_accepted_when_used():
    cfg = config_from_dict({}, ["algorithm.kl_coef=0.1", "algorithm.kl_estimator=k2",
                                "algorithm.kl_in=reward", "algorithm.entropy_coef=0.01",
                                "model.reference_offload=true"])
    assert cfg.algorithm.kl_estimator == "k2" and cfg.model.reference_offload


def _cmd(run_dir, *extra):
    # the demo's pretrained base (rewards vary, so the policy moves away from the reference)
    return [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir",
            str(run_dir), *FAST, *extra]


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")


def _kl(run_dir):
    rows = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


@pytest.mark.slow
def test_kl_run_resume_rebuilds_reference_from_initial_weights(tmp_path):
    kl = ["algorithm.kl_coef=0.05", "train.max_steps=4", "checkpoint.interval=2"]
    full = tmp_path / "full"
    out = subprocess.run(_cmd(full, *kl), cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ref = _kl(full)
    assert ref[0]["kl/mean"] < 1e-6  # the sampling policy is the reference at step 0
    assert ref[3]["kl/mean"] > ref[0]["kl/mean"] + 1e-4
    assert all(r["kl_loss"] >= 0 and r["kl/max"] >= r["kl/mean"] for r in ref.values())
    assert "KL reference (initial weights, frozen)" in (full / "events.log").read_text()

    part = tmp_path / "part"
    proc = subprocess.Popen(_cmd(part, *kl), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = part / "checkpoints" / "step_00000002" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    out = subprocess.run(_cmd(part, *kl, "train.resume=auto"), cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = _kl(part)
    for step in (2, 3):
        assert got[step]["kl/mean"] == pytest.approx(ref[step]["kl/mean"], rel=1e-6, abs=1e-9)
        assert got[step]["kl_loss"] == pytest.approx(ref[step]["kl_loss"], rel=1e-6, abs=1e-9)


@pytest.mark.slow
def test_kl_in_reward_with_grpo_and_entropy_runs(tmp_path):
    run = tmp_path / "r"
    out = subprocess.run(_cmd(run, "train.max_steps=2", "algorithm.loss=grpo",
                              "algorithm.kl_coef=0.1", "algorithm.kl_in=reward",
                              "algorithm.kl_estimator=k2", "algorithm.entropy_coef=0.01",
                              "model.reference_offload=true"),
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _kl(run)
    for r in rows.values():
        assert r["kl_loss"] == 0.0  # in the reward, not in the loss
        assert r["entropy_loss"] < 0 and r["entropy/mean"] > 0
        assert r["kl/reward_penalty_mean"] == pytest.approx(0.1 * r["kl/mean"])
    assert "kept on CPU between uses" in (run / "events.log").read_text()
