"""A conversion killed mid-write leaves a hidden temp dir; the next conversion writing next to it
removes it (with a message) when its owner is dead, and never touches a live conversion's."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_gspo.convert.hf_io import save_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]

# A conversion that writes one tensor, says so, then blocks (killed or left running by the test).
_WRITER = """
import sys, time, torch
from megatron_gspo.convert.hf_io import save_hf_checkpoint
out, ready = sys.argv[1], sys.argv[2]
def items():
    yield "a", torch.zeros(4)
    open(ready, "w").close()
    time.sleep(600)
    yield "b", torch.zeros(4)
save_hf_checkpoint(items(), out, side_files_from=None, max_shard_bytes=8)
"""


def _start_writer(out: Path, ready: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(out), str(ready)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    t0 = time.time()
    while not ready.exists():
        assert p.poll() is None and time.time() - t0 < 120, "writer did not start"
        time.sleep(0.1)
    return p


def _hidden(d: Path) -> set[str]:
    return {p.name for p in d.iterdir() if p.name.startswith(".")}


def test_dead_conversions_temp_dir_is_cleaned_live_one_kept(tmp_path, capfd):
    live = _start_writer(tmp_path / "model_b", tmp_path / "ready_b")
    try:
        dead = _start_writer(tmp_path / "model_a", tmp_path / "ready_a")
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        left = _hidden(tmp_path)
        assert len(left) == 2, left  # both temp dirs exist
        capfd.readouterr()
        save_hf_checkpoint([("x", torch.ones(2))], tmp_path / "model_c", side_files_from=None)
        err = capfd.readouterr().err
        now = _hidden(tmp_path)
        (dead_tmp,) = [n for n in left if "model_a" in n]
        (live_tmp,) = [n for n in left if "model_b" in n]
        assert dead_tmp not in now, "the dead conversion's temp dir was not removed"
        assert live_tmp in now, "a live conversion's temp dir was removed"
        assert dead_tmp in err and str(dead.pid) in err, err
        assert (tmp_path / "model_c" / "model.safetensors.index.json").is_file()
    finally:
        live.kill()
        live.wait()


def test_same_target_rewritten_after_a_kill(tmp_path, capfd):
    """Re-running the killed conversion (same --out, other pid) removes the leftover."""
    dead = _start_writer(tmp_path / "m", tmp_path / "ready")
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    assert len(_hidden(tmp_path)) == 1
    save_hf_checkpoint([("x", torch.ones(2))], tmp_path / "m", side_files_from=None)
    assert _hidden(tmp_path) == set() and (tmp_path / "m").is_dir()
    assert "removed" in capfd.readouterr().err


def test_reused_pid_and_old_foreign_dirs(tmp_path, monkeypatch):
    """A live pid with another start time is a reused pid (owner gone); a directory of another
    host counts as stale only after STALE_AFTER_S without changes; foreign hidden dirs stay."""
    import json

    from megatron_gspo.convert import tempdirs

    parent_pid = os.getppid()  # alive, but not the process that wrote the record
    reused = tmp_path / ".a.tmp-1"
    reused.mkdir()
    (reused / tempdirs.OWNER_FILE).write_text(json.dumps(
        {"pid": parent_pid, "host": tempdirs.socket.gethostname(), "started": 1.0}))
    remote = tmp_path / ".b.tmp-2"
    remote.mkdir()
    (remote / tempdirs.OWNER_FILE).write_text(json.dumps({"pid": 2, "host": "elsewhere"}))
    foreign = tmp_path / ".c.tmp"  # not ours: no owner record, not the target being written
    foreign.mkdir()
    removed = tempdirs.clean_stale(tmp_path, "d")
    assert removed == [reused] and remote.exists() and foreign.exists()
    monkeypatch.setattr(tempdirs, "STALE_AFTER_S", -1.0)
    assert tempdirs.clean_stale(tmp_path, "d") == [remote] and foreign.exists()


@pytest.mark.slow
def test_killed_hf_to_mcore_is_cleaned_by_the_next(tiny_hf, tmp_path):
    """hf-to-mcore (Megatron, torch_dist writer) killed while writing; the rerun cleans up."""
    argv = [sys.executable, "-W", "ignore", str(ROOT / "tools" / "convert_checkpoint.py"),
            "hf-to-mcore", "--hf", str(tiny_hf["Qwen3ForCausalLM"]), "--out",
            str(tmp_path / "ck"), "--no-progress"]
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not _hidden(tmp_path):
        assert p.poll() is None and time.time() - t0 < 120, "conversion ended before the check"
        time.sleep(0.02)
    p.kill()
    p.wait()
    (left,) = _hidden(tmp_path)
    assert not (tmp_path / "ck").exists()
    q = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert q.returncode == 0, q.stderr[-2000:]
    assert f"removed {tmp_path / left}" in q.stderr
    assert _hidden(tmp_path) == set() and (tmp_path / "ck" / "metadata.json").is_file()
