"""Run checkpoints (completion marker, crash safety, pruning) and the metrics logger."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_gspo.runtime.run_checkpoint import Checkpointer
from megatron_gspo.runtime.metrics import MetricsLogger, read_metrics


class FileLearner:
    """Stands for the learner's collective save/load: writes one tensor file."""

    def __init__(self, value=0.0, fail_on_save=False):
        self.w = torch.tensor([value])
        self.fail_on_save = fail_on_save

    def save_checkpoint(self, path):
        os.makedirs(path, exist_ok=True)
        torch.save(self.w, os.path.join(path, "w.pt"))
        if self.fail_on_save:
            raise RuntimeError("disk full")

    def load_checkpoint(self, path):
        self.w = torch.load(os.path.join(path, "w.pt"))


def test_save_load_latest_and_prune(tmp_path):
    ck = Checkpointer(tmp_path / "ck", keep_last=2)
    assert ck.latest() is None
    for step, v in ((2, 1.0), (4, 2.0), (6, 3.0)):
        ck.save(step, FileLearner(v), {"step": step, "data": {"pos": step * 10}})
    assert [s for s, _ in ck.complete()] == [4, 6]  # keep_last=2 pruned step 2
    step, path = ck.latest()
    assert step == 6 and (path / "COMPLETE").is_file()
    learner = FileLearner()
    state = ck.load(path, learner)
    assert learner.w.item() == 3.0 and state["data"]["pos"] == 60


def test_rng_state_restored(tmp_path):
    ck = Checkpointer(tmp_path / "ck")
    torch.manual_seed(7)
    ck.save(1, FileLearner(), {"step": 1})
    expect = torch.rand(4)
    torch.manual_seed(99)
    ck.load(ck.latest()[1], FileLearner())
    assert torch.equal(torch.rand(4), expect)


def test_crash_during_save_never_looks_complete(tmp_path):
    ck = Checkpointer(tmp_path / "ck")
    ck.save(3, FileLearner(1.0), {"step": 3})
    with pytest.raises(RuntimeError, match="disk full"):
        ck.save(5, FileLearner(2.0, fail_on_save=True), {"step": 5})
    assert ck.latest()[0] == 3
    assert (tmp_path / "ck" / ".tmp_step_00000005").exists()
    ck.clean_partial()
    assert not (tmp_path / "ck" / ".tmp_step_00000005").exists()
    # a renamed folder whose COMPLETE marker was never written is not complete either
    (tmp_path / "ck" / "step_00000009" / "model").mkdir(parents=True)
    assert ck.latest()[0] == 3
    with pytest.raises(ValueError, match="not complete"):
        ck.load(tmp_path / "ck" / "step_00000009", FileLearner())


def test_kill_9_during_save_leaves_previous_checkpoint(tmp_path):
    root = tmp_path / "ck"
    code = f"""
import os, signal, torch
from megatron_gspo.runtime.run_checkpoint import Checkpointer
class L:
    def save_checkpoint(self, path):
        os.makedirs(path, exist_ok=True)
        torch.save(torch.zeros(1), os.path.join(path, "w.pt"))
        if path.endswith("step_00000002/model"):
            os.kill(os.getpid(), signal.SIGKILL)
ck = Checkpointer({str(root)!r})
ck.save(1, L(), {{"step": 1}})
ck.save(2, L(), {{"step": 2}})
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert out.returncode == -9
    assert Checkpointer(root).latest()[0] == 1


def test_metrics_logger_jsonl_events_and_resume_truncation(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=4, tensorboard=True, progress_bar=False)
    for step in range(4):
        log.log(step, {"reward/mean": step / 10, "loss": float("nan"),
                       "precision/old_logprobs": "rollout"})
    log.event("hello")
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["reward/mean"] == 0.1 and rows[0]["loss"] is None
    assert rows[0]["precision/old_logprobs"] == "rollout"
    assert "hello" in (tmp_path / "events.log").read_text()
    assert any((tmp_path / "tensorboard").iterdir())
    # resuming from a checkpoint at step 2 drops records of steps >= 2
    log = MetricsLogger(tmp_path, start_step=2, tensorboard=False, progress_bar=False)
    log.log(2, {"reward/mean": 9.0})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert read_metrics(tmp_path)[-1]["reward/mean"] == 9.0
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "x", enabled=False)
    log.log(0, {"a": 1.0})
    log.event("nothing")
    log.close()
    assert not (tmp_path / "x").exists()
