"""Issue 54, defects 14 and 15: a torchrun job that may restart but checkpoints only at the end
is refused at start; a resume compares the config with the one its checkpoint records, keeps
each segment's config.yaml, writes the differences to events.log and refuses a change of what
the checkpoint means unless `train.resume_changes` names it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.runtime import restarts
from megatron_gspo.runtime.rundir import RunError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
SETTINGS = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
            "algorithm.mini_batches=2", "logging.progress_bar=false", "logging.tensorboard=false",
            "train.eval_interval=0", "logging.log_samples=0", "checkpoint.interval=1"]


def _train(run: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir", str(run),
           *SETTINGS, *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_restarts_with_only_a_final_checkpoint_are_refused_at_start(tmp_path):
    # what torchrun's local elastic agent exports to each worker for --max-restarts 3
    out = _train(tmp_path / "run", "checkpoint.interval=0", "train.max_steps=2",
                 env={"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert out.returncode != 0, "trained although every restart would start over at step 0"
    last = out.stderr.strip().splitlines()[-1]
    assert "checkpoint.interval: 0" in last and "--max-restarts 3" in last, out.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_interval_check_passes_what_can_resume(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    restarts.check_checkpoint_interval(5, 100)  # a checkpoint every 5 steps
    restarts.check_checkpoint_interval(0, 1)  # one step: nothing to lose
    with pytest.raises(RunError, match="checkpoint.interval=N"):
        restarts.check_checkpoint_interval(0, 100)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restarts: the end is enough
    restarts.check_checkpoint_interval(0, 100)
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS")  # not under torchrun
    restarts.check_checkpoint_interval(0, 100)


@pytest.mark.slow
def test_resume_refuses_an_unnamed_change_keeps_segments_and_logs_the_difference(tmp_path):
    run = tmp_path / "run"
    out = _train(run, "train.max_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    first = (run / "config.yaml").read_bytes()
    # another learning rate and loss: refused with one line naming both, nothing overwritten
    out = _train(run, "train.max_steps=3", "optimizer.lr=2.0e-4", "algorithm.loss=grpo")
    assert out.returncode != 0, "resumed with another learning rate and loss silently"
    last = out.stderr.strip().splitlines()[-1]
    assert "optimizer.lr 0.0001 -> 0.0002" in last and "algorithm.loss 'gspo' -> 'grpo'" in last
    assert "train.resume_changes=[optimizer.lr,algorithm.loss]" in last, last
    assert (run / "config.yaml").read_bytes() == first
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    # named: accepted, the difference in events.log, the first segment's config kept
    out = _train(run, "train.max_steps=3", "optimizer.lr=2.0e-4",
                 "train.resume_changes=[optimizer.lr]")
    assert out.returncode == 0, out.stderr[-3000:]
    events = (run / "events.log").read_text()
    assert ("config changed since step_00000002: optimizer.lr 0.0001 -> 0.0002 (named in "
            "train.resume_changes); train.max_steps 2 -> 3") in events, events
    assert "kept as config.1.yaml" in events
    assert (run / "config.1.yaml").read_bytes() == first
    assert load_config(run / "config.yaml").optimizer.lr == 2.0e-4
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


def test_config_changes_by_section_and_unknown_names(tmp_path):
    import json

    from megatron_gspo.loop.resume_checks import config_changes, config_record

    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    (ckpt / "trainer.json").write_text(json.dumps(
        {"step": 4, "config": config_record(load_config(CONFIG))}))
    same = load_config(CONFIG, ["checkpoint.keep_last=5", "logging.log_samples=0"])
    assert config_changes(same, ckpt) == ("config changed since step_00000004: logging."
                                          "log_samples 2 -> 0; checkpoint.keep_last 2 -> 5")
    seed = load_config(CONFIG, ["train.seed=7"])
    with pytest.raises(ConfigError, match=r"train.seed 1234 -> 7 .*resume_changes=\[train.seed\]"):
        config_changes(seed, ckpt)
    section = load_config(CONFIG, ["optimizer.lr=1.0e-3", "optimizer.weight_decay=0.1",
                                   "train.resume_changes=[optimizer]"])
    assert "optimizer.weight_decay 0.0 -> 0.1 (named" in config_changes(section, ckpt)
    typo = load_config(CONFIG, ["train.resume_changes=[optimizer.learning_rate]"])
    with pytest.raises(ConfigError, match="train.resume_changes: .*learning_rate"):
        config_changes(typo, ckpt)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 4}))  # an older checkpoint
    assert config_changes(seed, ckpt) == ""
