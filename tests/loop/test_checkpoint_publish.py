"""Issue 54, defects 4 and 5: an asynchronous save starts only once the previous one is
published, `events.log` names a checkpoint only once its COMPLETE is durable (so a kill before
the first publish leaves a run that starts over instead of one refused as "metrics without a
checkpoint"), and a checkpoint folder without COMPLETE is moved aside with an event line
instead of being deleted silently."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from megatron_gspo.runtime.run_checkpoint import Checkpointer, verify

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
SETTINGS = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
            "algorithm.mini_batches=2", "logging.progress_bar=false", "logging.tensorboard=false",
            "train.eval_interval=0", "logging.log_samples=0", "checkpoint.interval=1",
            "checkpoint.keep_last=3", "train.max_steps=3", "checkpoint.async_save=true"]


def _train(run: Path, fault: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("MEGATRON_GSPO_FAULT", None)
    if fault:
        env["MEGATRON_GSPO_FAULT"] = fault
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir", str(run),
           *SETTINGS]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_async_save_waits_for_the_previous_publish_and_logs_only_published(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    # checkpoint 1's publish is late (a busy machine) and killed between rename and COMPLETE
    out = _train(run, "delay_publish@1,kill_before_complete@1")
    assert out.returncode == -9, out.stderr[-3000:]
    saves = sorted(p.name for p in root.iterdir() if "step_" in p.name)
    assert saves == ["step_00000001"], saves  # save 2 had not started (no .tmp_step_00000002)
    events = (run / "events.log").read_text()
    assert "] checkpoint " not in events, events  # nothing was published, nothing said so
    # what is left is a run that starts over (its only checkpoint never got COMPLETE) ...
    out = _train(run)
    assert out.returncode == 0, out.stderr[-3000:]
    events = (run / "events.log").read_text()
    assert "moved aside to incomplete_step_00000001" in events
    assert "starting from the initial weights" in events
    assert (root / "incomplete_step_00000001" / "trainer.json").is_file()
    done = Checkpointer(root).complete()
    assert [s for s, _ in done] == [1, 2, 3] and all(verify(p) is None for _, p in done)
    # ... and every checkpoint line names a published checkpoint, after its COMPLETE
    named = [ln.split("] checkpoint ", 1)[1].split(" ", 1)[0] for ln in events.splitlines()
             if "] checkpoint " in ln]
    assert [Path(p).name for p in named] == ["step_00000001", "step_00000002", "step_00000003"]
    assert all("(asynchronous; COMPLETE durable" in ln for ln in events.splitlines()
               if "] checkpoint " in ln)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]


class _FileLearner:
    chunks: list = []

    def save_checkpoint(self, path):
        os.makedirs(path, exist_ok=True)
        torch.save(torch.ones(3), os.path.join(path, "w.pt"))


def test_a_folder_without_complete_is_moved_aside_with_an_event(tmp_path):
    root = tmp_path / "ck"
    ck = Checkpointer(root)
    ck.save(3, _FileLearner(), {"step": 3})
    killed = root / "step_00000005"  # renamed, killed before its COMPLETE marker
    (killed / "model").mkdir(parents=True)
    (killed / "model" / "w.pt").write_bytes(b"weights")
    (root / ".tmp_step_00000007").mkdir()  # a save killed while writing: removed
    ck.clean_partial()
    assert not killed.exists() and not (root / ".tmp_step_00000007").exists()
    assert (root / "incomplete_step_00000005" / "model" / "w.pt").read_bytes() == b"weights"
    assert [s for s, _ in ck.complete()] == [3]
    assert any("step_00000005" in e and "moved aside to incomplete_step_00000005" in e
               for e in ck.events), ck.events
    assert not any(e.startswith("checkpoint ") for e in ck.events)  # not a published one
