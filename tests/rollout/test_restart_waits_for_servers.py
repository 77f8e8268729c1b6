"""After a torchrun restart, the new round's first server starts only once the dead round's
servers are gone and their GPU memory is back (`runtime.server_record`, issue 53 defect 7). The
rounds are real processes with the same parent (the agent); the dead round's server is a
stand-in that takes 8 s to end once its guard is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_gspo.runtime import server_record
from megatron_gspo.runtime.rundir import RunError

ROOT = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, "-m", "tests.rollout._restart_wait_worker"]


def _env(tmp_path, rnd: int) -> dict:
    return dict(os.environ, TMPDIR=str(tmp_path), TORCHELASTIC_RUN_ID="restart-wait-test",
                TORCHELASTIC_RESTART_COUNT=str(rnd), PYTHONWARNINGS="ignore")


def _dead_round(tmp_path, die: str) -> int:
    """Round 0 launches its stand-in server, then dies with the server's guard (the server
    itself lingers): returns the stand-in's pid."""
    old = subprocess.Popen([*WORKER, str(tmp_path), "old", die], cwd=ROOT,
                           env=_env(tmp_path, 0), stdout=subprocess.PIPE, text=True)
    guard = json.loads(old.stdout.readline())["guard"]
    pid_file = tmp_path / "old_pid"
    for _ in range(400):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    os.kill(guard, signal.SIGKILL)  # (without its sweep: the server outlives it a while)
    old.kill()
    old.wait()
    return int(pid_file.read_text())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_new_round_starts_its_server_after_the_dead_rounds_ended(tmp_path):
    old_pid = _dead_round(tmp_path, "8")
    assert _alive(old_pid)
    new = subprocess.run([*WORKER, str(tmp_path), "new"], cwd=ROOT, env=_env(tmp_path, 1),
                         capture_output=True, text=True, timeout=120)
    assert new.returncode == 0, new.stderr[-3000:]
    out = json.loads(new.stdout.strip().splitlines()[-1])
    for _ in range(300):  # (today's code launched while the old server still ran)
        if (tmp_path / "old_exit").exists():
            break
        time.sleep(0.05)
    old_exit = float((tmp_path / "old_exit").read_text())
    new_start = float((tmp_path / "new_start").read_text())
    assert new_start >= old_exit, (new_start - out["asked"], old_exit - out["asked"])
    assert out["asked"] < old_exit - 1.0  # asked while the old server still ran: it waited
    # the record holds this round's server only; stopping it emptied the record
    assert [(e["round"], e["gpus"]) for e in out["record"]] == [(1, [0, 1])]
    assert not list((tmp_path / "megatron_gspo_servers").glob("*.json"))


def test_a_server_that_does_not_end_is_one_line_naming_pid_and_gpus(tmp_path):
    old_pid = _dead_round(tmp_path, "never")
    try:
        new = subprocess.run([*WORKER, str(tmp_path), "new-short"], cwd=ROOT,
                             env=_env(tmp_path, 1), capture_output=True, text=True, timeout=120)
        assert new.returncode == 0, new.stderr[-3000:]
        err = json.loads(new.stdout.strip().splitlines()[-1])["error"]
        assert "\n" not in err and "automatic restart 1:" in err
        assert "stand-in server 0 pid" in err and "(GPUs 0,1)" in err and "after 2 s" in err
        assert not (tmp_path / "new_start").exists()  # nothing was launched
    finally:
        os.kill(old_pid, signal.SIGKILL)


class _FakeGPU:
    """Device 0 whose available memory comes back after `polls` reads."""

    def __init__(self, polls: int):
        self.reads = 0
        self.polls = polls

    def __call__(self):
        self.reads += 1
        return (0, (8 if self.reads > self.polls else 2) * 2**30, 80 * 2**30)


def _old_entry(path: Path, available: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    gone = subprocess.Popen(["true"])
    gone.wait()  # its server process ended; the memory it held may still be on its way back
    path.write_text(json.dumps({"servers": [{"round": 0, "pid": gone.pid, "start": None,
                                             "gpus": [0], "name": "sglang server 0",
                                             "device": 0, "available": available}]}))


def test_waits_for_the_gpu_memory_of_the_dead_round(tmp_path):
    path = tmp_path / "record.json"
    _old_entry(path, 8 * 2**30)
    gpu = _FakeGPU(polls=5)
    waited = server_record.wait_for_earlier_rounds(path, 1, timeout_s=30, available=gpu)
    assert gpu.reads >= 6 and waited >= 4 * server_record.POLL_S
    assert not path.exists()  # the dead round's entries are dropped once gone
    _old_entry(path, 8 * 2**30)
    with pytest.raises(RunError, match=r"GPU 0 has 2\.0 GiB available after 0 s, 8\.0 GiB "
                                       r"when round 0 launched its servers"):
        server_record.wait_for_earlier_rounds(path, 1, timeout_s=0.3,
                                              available=_FakeGPU(polls=10**6))
    # memory within the slack of what the dead round had: no wait
    _old_entry(path, 3 * 2**30)
    assert server_record.wait_for_earlier_rounds(path, 1, timeout_s=0.3,
                                                 available=_FakeGPU(polls=10**6)) < 0.3
