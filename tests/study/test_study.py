"""`megatron-gspo study`: strict study files, 2 arms x 2 steps end to end (summary.json, PNG),
a killed study resumes (finished arms not rerun, the half-done arm continues) and repeats the
uninterrupted study's numbers exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_gspo.config import ConfigError
from megatron_gspo.runtime.metrics import MetricsLogger, read_metrics
from megatron_gspo.study import arm_configs, load_study
from megatron_gspo.study.study_report import plot_study, summarize

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
FAST = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "logging.tensorboard=false", "train.eval_interval=1", "train.eval_prompts=8",
        "checkpoint.interval=1", "logging.log_samples=0", "optimizer.lr=1e-3"]
PNG = b"\x89PNG\r\n\x1a\n"


def _study(tmp_path, steps, arms=None, extra="", name="s.yaml"):
    arms = arms or {"gspo": [], "grpo": ["algorithm.loss=grpo"]}
    common = json.dumps(FAST + [f"train.max_steps={steps}"])
    text = (f"base: {TINY}\ndescription: test\noverrides: {common}\narms:\n"
            + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in arms.items()) + extra)
    p = tmp_path / name
    p.write_text(text)
    return p


def _err(path):
    with pytest.raises(ConfigError) as e:
        spec, base = load_study(path)
        arm_configs(spec, base, path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_study_file_is_strict(tmp_path):
    assert "extra: unknown key" in _err(_study(tmp_path, 2, extra="extra: 1\n"))
    msg = _err(_study(tmp_path, 2, arms={"a": [], "bad": ["algorithm.losss=grpo"]}))
    assert "arms.bad" in msg and "algorithm.losss" in msg
    msg = _err(_study(tmp_path, 2, arms={"a": [], "b": ["algorithm.loss=ppo"]}))
    assert "arms.b" in msg and "algorithm.loss" in msg
    msg = _err(_study(tmp_path, 2, arms={"a": [], "b": ["train.seed=7"]}))
    assert "arms.b: train.seed=7 differs" in msg
    assert "arms.b" in _err(_study(tmp_path, 2, arms={"a": [], "b": "algorithm.loss=grpo"}))
    assert "arms.x y" in _err(_study(tmp_path, 2, arms={"x y": []}))
    p = tmp_path / "nobase.yaml"
    p.write_text("arms:\n  a: []\n")
    assert "base: required" in _err(p)
    spec, base = load_study(_study(tmp_path, 2))
    assert list(arm_configs(spec, base)) == ["gspo", "grpo"] and base == TINY
    arms = arm_configs(spec, base, extra=["train.max_steps=1"])  # command-line overrides
    assert all(cfg.train.max_steps == 1 for _, cfg in arms.values())
    assert arms["grpo"][1].algorithm.loss == "grpo"


def _fake_arm(d, clip, steps=3):
    log = MetricsLogger(d, tensorboard=False, progress_bar=False)
    for s in range(steps):
        log.log(s, {"reward/mean": 0.1 * s, "clip_fraction": clip,
                    "clip_fraction/first_minibatch": clip / 10, "ratio/spread": 1e-3,
                    "grad_norm": 1.0 + s, "moe/expert_change_rate": 0.1,
                    "eval/reward_mean": 0.5 if s == 2 else None, "time/step": 2.0})
    log.close()


def test_summary_and_png_from_metrics(tmp_path):
    _fake_arm(tmp_path / "a", 0.15)
    _fake_arm(tmp_path / "b", 1e-3)
    s = summarize(tmp_path, ["a", "b"], "d")
    a = s["arms"]["a"]
    assert a["status"] == "not started" and a["train_time_s"] == 6.0
    m = a["metrics"]
    assert m["steps"] == 3 and m["reward/final"] == pytest.approx(0.2)
    assert m["reward/mean"] == pytest.approx(0.1) and m["eval/reward_final"] == 0.5
    assert m["clip_fraction/mean"] == pytest.approx(0.15)
    assert m["clip_fraction/first_minibatch/mean"] == pytest.approx(0.015)
    assert m["moe/expert_change_rate/mean"] == pytest.approx(0.1)
    assert s["arms"]["b"]["metrics"]["clip_fraction/mean"] == pytest.approx(1e-3)
    png = plot_study(tmp_path, ["a", "b"])
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")


def _cli(study, out):
    return [sys.executable, "-m", "megatron_gspo.cli", "study", str(study), "--out", str(out)]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("study")
    study = _study(d, 2)
    r = subprocess.run(_cli(study, d / "out"), cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, study, r


@pytest.mark.slow
def test_two_arms_two_steps_summary_and_png(full):
    d, study, _ = full
    out = d / "out"
    s = json.loads((out / "summary.json").read_text())
    assert list(s["arms"]) == ["gspo", "grpo"] and s["description"] == "test"
    for name, arm in s["arms"].items():
        rows = read_metrics(out / name)
        m = arm["metrics"]
        assert arm["status"] == "done" and m["steps"] == 2 and len(rows) == 2
        assert m["reward/final"] == rows[-1]["reward/mean"]  # last tenth of 2 steps = 1 step
        assert m["eval/steps"] == [0, 1]
        for k in ("clip_fraction/mean", "clip_fraction/first_minibatch/mean",
                  "clip_fraction/later_minibatches/mean", "grad_norm/mean", "ratio/spread/mean"):
            assert isinstance(m[k], float), (name, k)
        assert arm["wall_time_s"] > 0 and arm["attempts"] == 1
    assert "algorithm.loss=grpo" in s["arms"]["grpo"]["overrides"]
    assert "algorithm.loss=grpo" not in s["arms"]["gspo"]["overrides"]
    cfg = (out / "grpo" / "config.yaml").read_text()
    assert "loss: grpo" in cfg and "loss: grpo" not in (out / "gspo" / "config.yaml").read_text()
    # GRPO's 0.2/0.28 token range clips far less than GSPO's 3e-4/4e-4 sequence range.
    g, r = s["arms"]["gspo"]["metrics"], s["arms"]["grpo"]["metrics"]
    assert g["clip_fraction/mean"] > r["clip_fraction/mean"]
    png = out / "study.png"
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000


@pytest.mark.slow
def test_killed_study_resumes_and_repeats_the_numbers(full, tmp_path):
    d, _, _ = full
    ref = json.loads((d / "out" / "summary.json").read_text())
    study = _study(tmp_path, 2)
    out = tmp_path / "out"
    proc = subprocess.Popen(_cli(study, out), cwd=ROOT, env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = out / "grpo" / "checkpoints" / "step_00000001" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the second arm never saved its first checkpoint"
    os.killpg(proc.pid, signal.SIGKILL)  # the study and its training process
    proc.wait()
    assert not (out / "summary.json").exists()
    assert json.loads((out / "gspo" / "study_arm.json").read_text())["status"] == "done"
    r = subprocess.run(_cli(study, out), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "arm gspo: finished earlier, not rerun" in r.stderr
    assert "resumed from" in (out / "grpo" / "events.log").read_text()
    assert "resumed from" not in (out / "gspo" / "events.log").read_text()
    got = json.loads((out / "summary.json").read_text())
    for name in ("gspo", "grpo"):
        assert got["arms"][name]["metrics"] == ref["arms"][name]["metrics"], name


def test_shipped_studies_load():
    for study in sorted((ROOT / "examples" / "study").glob("*.yaml")):
        spec, base = load_study(study)
        arms = arm_configs(spec, base, study)
        assert len(arms) >= 2, study
        losses = {cfg.algorithm.loss for _, cfg in arms.values()}
        assert {"gspo", "grpo"} <= losses, study
