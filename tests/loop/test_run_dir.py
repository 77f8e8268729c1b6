"""Run-directory safety: checksummed checkpoints with fallback, pickle-free loading, strict RNG
restore, no checkpoint of non-finite weights, one writer per run dir, `resume: never` refusal,
config bounds that rule out NaN."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.runtime.run_checkpoint import Checkpointer
from megatron_gspo.config import ConfigError, config_from_dict

ROOT = Path(__file__).resolve().parents[2]


class FileLearner:
    """Stands for the learner's collective save/load: one parameter, one tensor file."""

    def __init__(self, value=0.0):
        self.chunks = [torch.nn.Linear(1, 1, bias=False)]
        with torch.no_grad():
            self.chunks[0].weight.fill_(value)

    @property
    def w(self):
        return self.chunks[0].weight

    def save_checkpoint(self, path):
        os.makedirs(path, exist_ok=True)
        torch.save({"w": self.w.detach().clone(), "pad": torch.zeros(256)},
                   os.path.join(path, "w.pt"))

    def load_checkpoint(self, path):
        with torch.no_grad():
            self.w.copy_(torch.load(os.path.join(path, "w.pt"), weights_only=True)["w"])


def _two_checkpoints(root):
    ck = Checkpointer(root, keep_last=3)
    ck.save(1, FileLearner(1.0), {"step": 1, "data": {"pos": 1}})
    ck.save(2, FileLearner(2.0), {"step": 2, "data": {"pos": 2}})
    return ck


def _flip_byte(path: Path, at: int = -20) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete_rng"])
def test_damaged_newest_falls_back_to_previous_complete(tmp_path, damage):
    ck = _two_checkpoints(tmp_path / "ck")
    newest = tmp_path / "ck" / "step_00000002"
    w = newest / "model" / "w.pt"
    size = w.stat().st_size
    if damage == "flip":  # same size, different bytes
        _flip_byte(w)
        assert w.stat().st_size == size
    elif damage == "truncate":
        w.write_bytes(w.read_bytes()[: size // 2])
    else:
        (newest / "rng_rank0.pt").unlink()
    point = ck.resume_point()
    assert point is not None and point.step == 1, point
    assert any("step_00000002" in e and "damaged" in e for e in point.events), point.events
    learner = FileLearner()
    state = ck.load(point.path, learner, verified=True)
    assert state["step"] == 1 and learner.w.item() == 1.0
    # nothing complete-looking is left damaged
    assert [s for s, _ in ck.complete()] == [1]


def test_damaged_explicit_checkpoint_is_a_clear_error(tmp_path):
    from megatron_gspo.runtime.run_checkpoint import CheckpointError

    ck = _two_checkpoints(tmp_path / "ck")
    _flip_byte(tmp_path / "ck" / "step_00000002" / "model" / "w.pt")
    with pytest.raises(CheckpointError, match=r"step_00000002.*w\.pt"):
        ck.load(tmp_path / "ck" / "step_00000002", FileLearner())


def test_missing_rng_file_is_an_error(tmp_path):
    from megatron_gspo.runtime.run_checkpoint import CheckpointError

    ck = _two_checkpoints(tmp_path / "ck")
    (tmp_path / "ck" / "step_00000002" / "rng_rank0.pt").unlink()
    with pytest.raises(CheckpointError, match="rng_rank0.pt"):
        ck.load(tmp_path / "ck" / "step_00000002", FileLearner())


def test_run_checkpoints_load_without_pickle(tmp_path, monkeypatch):
    ck = _two_checkpoints(tmp_path / "ck")
    real = torch.load

    def strict(*a, **k):
        assert k.get("weights_only") is True, "run checkpoint loaded with pickle"
        return real(*a, **k)

    monkeypatch.setattr(torch, "load", strict)
    state = ck.load(ck.latest()[1], FileLearner())
    assert state["data"] == {"pos": 2}
    assert not list((tmp_path / "ck").glob("*/trainer.pt"))


def test_checkpoint_of_nonfinite_weights_is_refused(tmp_path):
    from megatron_gspo.runtime.run_checkpoint import CheckpointError

    ck = _two_checkpoints(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="non-finite"):
        ck.save(3, FileLearner(float("nan")), {"step": 3})
    assert ck.latest()[0] == 2
    assert not (tmp_path / "ck" / "step_00000003").exists()


def test_config_bounds_rule_out_nan():
    bad = [{"algorithm": {"advantage_eps": 0}}, {"optimizer": {"lr": float("inf")}},
           {"optimizer": {"lr": float("nan")}}, {"algorithm": {"logratio_bound": float("inf")}},
           {"rollout": {"temperature": 0}}, {"optimizer": {"lr": "1e400"}}]
    for data in bad:
        with pytest.raises(ConfigError):
            config_from_dict(data)
    cfg = config_from_dict({"train": {"max_skipped_steps": 2}})
    assert cfg.train.max_skipped_steps == 2


def _holder(run_dir: Path):
    code = ("import sys, time; from megatron_gspo.runtime.rundir import RunDirLock; "
            f"lock = RunDirLock({str(run_dir)!r}); lock.acquire(); print('held', flush=True); "
            "time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    from megatron_gspo.runtime.rundir import RunDirLock, RunError

    run = tmp_path / "run"
    p = _holder(run)
    try:
        with pytest.raises(RunError, match=rf"pid {p.pid} on host {socket.gethostname()}"):
            RunDirLock(run).acquire()
    finally:
        p.kill()
        p.wait()
    lock = RunDirLock(run)  # the holder died by SIGKILL: its lock file is stale
    lock.acquire()
    assert f"pid {p.pid}" in lock.takeover_note
    held = json.loads((run / "run.lock").read_text())
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    lock.release()
    assert not (run / "run.lock").exists()


def test_a_child_forked_by_the_writer_does_not_keep_the_lock(tmp_path):
    """A killed trainer's forked children (checkpoint writer, multiprocessing manager) may
    outlive it for a moment; the run dir must be free as soon as the trainer itself is gone."""
    from megatron_gspo.runtime.rundir import RunDirLock, RunError

    run = tmp_path / "run"
    code = ("import os, sys, time; from megatron_gspo.runtime.rundir import RunDirLock; "
            f"lock = RunDirLock({str(run)!r}); lock.acquire(); "
            "child = os.fork()\n"
            "if child == 0:\n    time.sleep(120); os._exit(0)\n"
            "print(child, flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True)
    child = int(p.stdout.readline())
    try:
        with pytest.raises(RunError):
            RunDirLock(run).acquire()
        with pytest.raises(RunError):  # one process never holds a run dir twice
            with RunDirLock(tmp_path / "mine"):
                RunDirLock(tmp_path / "mine").acquire()
        p.kill()
        p.wait()
        os.kill(child, 0)  # the forked child still lives ...
        with RunDirLock(run) as lock:  # ... and does not hold the run dir
            assert f"pid {p.pid}" in lock.takeover_note
    finally:
        p.kill()
        p.wait()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cli(args, env_extra=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "megatron_gspo.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


FAST = ["train.max_steps=1", "train.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=2", "algorithm.mini_batches=1", "logging.progress_bar=false",
        "logging.tensorboard=false", "train.eval_interval=0", "logging.log_samples=0"]


def test_second_writer_and_resume_never_fail_with_one_line(random_tiny_model, tmp_path):
    cfg = str(ROOT / "examples" / "tiny" / "config.yaml")
    run = tmp_path / "run"
    p = _holder(run)
    try:
        out = _cli(["train", cfg, "--run-dir", str(run), f"model.path={random_tiny_model}",
                    *FAST])
    finally:
        p.kill()
        p.wait()
    err = [ln for ln in out.stderr.splitlines() if ln.startswith("megatron-gspo:")]
    assert out.returncode == 2 and len(err) == 1, out.stderr[-2000:]
    assert f"pid {p.pid}" in err[0] and "Traceback" not in out.stderr
    assert not (run / "metrics.jsonl").exists()

    old = tmp_path / "old"
    ck = Checkpointer(old / "checkpoints")
    ck.save(4, FileLearner(1.0), {"step": 4})
    (old / "metrics.jsonl").write_text('{"step": 0}\n')
    out = _cli(["train", cfg, "--run-dir", str(old), f"model.path={random_tiny_model}",
                "train.resume=never", *FAST])
    err = [ln for ln in out.stderr.splitlines() if ln.startswith("megatron-gspo:")]
    assert out.returncode == 2 and len(err) == 1, out.stderr[-2000:]
    assert str(old) in err[0] and "resume" in err[0]
    assert (old / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert ck.latest()[0] == 4 and not (old / "run.lock").exists()


def test_other_world_size_skips_rng_with_an_event(tmp_path):
    ck = _two_checkpoints(tmp_path / "ck")
    path = tmp_path / "ck" / "step_00000002"
    marker = json.loads((path / "COMPLETE").read_text())
    marker["world_size"] = 2  # as if written by two ranks: rng_rank1.pt has no reader here
    (path / "COMPLETE").write_text(json.dumps(marker))
    state = ck.load(path, FileLearner())
    assert state["step"] == 2
    assert any("RNG states not restored" in e for e in ck.events), ck.events


@pytest.mark.slow
def test_two_ranks_resume_past_a_damaged_checkpoint_and_skip_nan_steps(tmp_path):
    """Under torchrun (TP=2) the collective paths agree: checkpoint verification on rank 0,
    the fallback broadcast, the non-finite skip decision."""
    cfg = str(ROOT / "examples" / "tiny" / "config.yaml")
    run = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]
    args = ["-m", "megatron_gspo.cli", "train", cfg, "--run-dir", str(run), "parallel.tensor=2",
            "checkpoint.interval=1", "checkpoint.keep_last=3", *FAST[1:]]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               MEGATRON_GSPO_FAULT="nan_loss@1")
    out = subprocess.run([*torchrun, *args, "train.max_steps=3"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update_skipped"] for r in rows] == [0.0, 1.0, 0.0]
    ck = Checkpointer(run / "checkpoints")
    assert [s for s, _ in ck.complete()] == [1, 2, 3]
    shard = max((f for f in (run / "checkpoints" / "step_00000003" / "model").rglob("*")
                 if f.is_file()), key=lambda f: f.stat().st_size)
    _flip_byte(shard, at=shard.stat().st_size // 2)
    out = subprocess.run([*torchrun, *args, "train.max_steps=4"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    events = (run / "events.log").read_text()
    assert "damaged_step_00000003" in events and "resumed from" in events
    again = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [0, 1, 2, 3]
    timing = ("time", "time/", "tokens_per_s", "time_fwd_bwd", "time_optimizer")
    strip = [{k: v for k, v in r.items() if not k.startswith(timing)} for r in (rows[2], again[2])]
    assert strip[0] == strip[1]  # step 2 re-run from the step-2 checkpoint reproduces itself
    assert [s for s, _ in ck.complete()][-1] == 4 and not (run / "run.lock").exists()
