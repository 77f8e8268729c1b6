"""The RL loop end to end through the CLI: kill -9 and resume reproduce the uninterrupted run;
bad config, data rows and files fail with one-line errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
FAST = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "algorithm.mini_batches=2", "logging.progress_bar=false", "logging.tensorboard=false",
        "train.eval_interval=0", "logging.log_samples=0", "optimizer.lr=1e-3",
        "precision.audit_fraction=0.5"]
TIMING = ("time", "time/", "tokens_per_s", "time_fwd_bwd", "time_optimizer")


def _cmd(model, run_dir, *extra):
    return [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir",
            str(run_dir), f"model.path={model}", *FAST, *extra]


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")


def _metrics(run_dir):
    rows = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows}


@pytest.mark.slow
def test_kill_9_and_resume_reproduce_the_uninterrupted_run(random_tiny_model, tmp_path):
    full = tmp_path / "full"
    out = subprocess.run(_cmd(random_tiny_model, full, "train.max_steps=4",
                              "checkpoint.interval=2"),
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ref = _metrics(full)
    assert sorted(ref) == [0, 1, 2, 3]

    part = tmp_path / "part"
    proc = subprocess.Popen(_cmd(random_tiny_model, part, "train.max_steps=4",
                                 "checkpoint.interval=2"),
                            cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    marker = part / "checkpoints" / "step_00000002" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    out = subprocess.run(_cmd(random_tiny_model, part, "train.max_steps=4",
                              "checkpoint.interval=2", "train.resume=auto"),
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in (part / "events.log").read_text()
    got = _metrics(part)
    assert sorted(got) == [0, 1, 2, 3]
    for step in (2, 3):
        assert got[step] == ref[step], step


def _run_cli(args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "megatron_gspo.cli", *args], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=300)


def test_bad_inputs_fail_with_one_line_errors(random_tiny_model, tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train:\n  max_stepz: 3\n")
    bad_rows = tmp_path / "rows.jsonl"
    bad_rows.write_text('{"prompt": "What is 1+2?", "answer": "3"}\n{"answer": "4"}\n')
    cases = [
        (["train", str(bad_yaml)], "train.max_stepz: unknown key"),
        (["train", "missing.yaml"], "config file not found: missing.yaml"),
        (["train", str(CONFIG), "algorithm.eps_high=x"], "algorithm.eps_high: expected float"),
        (["train", str(CONFIG), "model.path=/nonexistent"], "model.path: /nonexistent has no"),
        (["train", str(CONFIG), f"model.path={random_tiny_model}",
          f"data.train_path={bad_rows}"], "rows.jsonl line 2"),
        (["train", str(CONFIG), f"model.path={random_tiny_model}",
          "data.train_path=/nonexistent.jsonl"], "dataset file not found"),
        (["train", str(CONFIG), f"model.path={random_tiny_model}", "reward.name=nope"],
         "nope"),
    ]
    for args, needle in cases:
        out = _run_cli(args + ["--run-dir", str(tmp_path / "r")])
        assert out.returncode == 2, (args, out.stderr[-2000:])
        err = [ln for ln in out.stderr.splitlines() if ln.startswith("megatron-gspo:")]
        assert len(err) == 1 and needle in err[0], (needle, out.stderr[-2000:])
        assert "Traceback" not in out.stderr
