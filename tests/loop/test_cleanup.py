"""What a run starts ends with it: launched servers die with a trainer killed by SIGKILL, and a
run that fails with an error still stops its engine and releases its process group."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _state(pid: int) -> str:
    """The kernel's state letter of `pid` ('' once it is gone; 'Z' a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def test_launched_server_dies_with_a_trainer_killed_by_sigkill():
    code = ("import sys, time; from megatron_gspo.rollout.sglang.launch import ServerProcess; "
            "p = ServerProcess([sys.executable, '-c', 'import time; time.sleep(300)'], 'server'); "
            "time.sleep(1.0); print(p.proc.pid, flush=True); time.sleep(300)")
    trainer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True)
    server = int(trainer.stdout.readline())
    try:
        cmdline = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
        assert b"time.sleep(300)" in cmdline[-2], cmdline  # the command itself, same pid
        assert os.getpgid(server) == server  # its own process group: stop() kills the group
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 10
        while _state(server) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(server) in ("", "Z"), "the server outlived the killed trainer"
    finally:
        trainer.kill()
        try:
            os.kill(server, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_failing_run_stops_its_engine_and_releases_the_process_group(random_tiny_model,
                                                                       tmp_path):
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_cleanup_worker.py")),
                          str(tmp_path / "run"), str(random_tiny_model)],
                         cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore",
                                            OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    assert json.loads(line[0][len("RESULT "):]) == {
        "error": "injected failure in the training phase", "engine_shut_down": True,
        "process_group_released": True, "lock_left": False}
