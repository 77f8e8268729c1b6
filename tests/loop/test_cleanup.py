"""What a run starts ends with it: launched servers die with a trainer killed by SIGKILL, and a
run that fails with an error still stops its engine and releases its process group."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def _state(pid: int) -> str:
    """The kernel's state letter of `pid` ('' once it is gone; 'Z' a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids of `pids` still running (not gone, not a zombie) after up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while any(_state(p) not in ("", "Z") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _state(p) not in ("", "Z")]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# a server that starts a helper arming its own PR_SET_PDEATHSIG only after a delay, as SGLang's
# scheduler and detokenizer do after their spawn and imports (kill_itself_when_parent_died() in
# sglang/srt/managers/detokenizer_manager.py); the helper writes its pid to argv[1] first
_HELPER = ("import ctypes, os, signal, sys, time; open(sys.argv[1], 'w').write(str(os.getpid()));"
           " time.sleep(float(sys.argv[2]));"
           " ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0); time.sleep(300)")
_SERVER = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', HELPER,"
           " sys.argv[1], sys.argv[2]]); time.sleep(float(sys.argv[3])); sys.exit(3)")


def _server_argv(pid_file: Path, arm_after: float, exit_after: float) -> list[str]:
    return [sys.executable, "-c", _SERVER.replace("HELPER", repr(_HELPER)), str(pid_file),
            str(arm_after), str(exit_after)]


def test_launched_server_dies_with_a_trainer_killed_by_sigkill():
    code = ("import sys, time; from megatron_gspo.rollout.sglang.launch import ServerProcess; "
            "p = ServerProcess([sys.executable, '-c', 'import time; time.sleep(300)'], 'server'); "
            "time.sleep(1.0); print(p.proc.pid, flush=True); time.sleep(300)")
    trainer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True)
    guard = int(trainer.stdout.readline())
    pids = [guard]
    try:
        assert os.getpgid(guard) == guard == os.getsid(guard)  # own session: stop() kills it
        (server,) = psutil.Process(guard).children()
        pids.append(server.pid)
        assert server.cmdline()[-1] == "import time; time.sleep(300)"
        trainer.kill()
        trainer.wait()
        assert _gone(pids) == [], "the server outlived the killed trainer"
    finally:
        trainer.kill()
        _kill_all(pids)


def test_a_server_killed_while_its_helpers_start_leaves_none_of_them(tmp_path):
    """The trainer is killed before the server's helper armed its own PR_SET_PDEATHSIG: the
    helper was left running for good (reparented to init) before the guard swept sessions."""
    pid_file = tmp_path / "helper.pid"
    code = ("import sys, time; from megatron_gspo.rollout.sglang.launch import ServerProcess; "
            f"p = ServerProcess({_server_argv(pid_file, 3.0, 300)!r}, 'server'); "
            "print(p.proc.pid, flush=True); time.sleep(300)")
    trainer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True)
    pids = [int(trainer.stdout.readline())]
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the helper never started"
            time.sleep(0.02)
        pids.append(int(pid_file.read_text()))  # started, not armed yet (3 s)
        pids += [c.pid for c in psutil.Process(pids[0]).children(recursive=True)]
        trainer.kill()
        trainer.wait()
        assert _gone(pids) == [], "a process of the killed trainer's server is left"
    finally:
        trainer.kill()
        _kill_all(pids)


def test_a_server_that_exits_leaves_nothing_and_reports_its_own_exit(tmp_path):
    """The server exits (code 3) before its helper armed anything: the helper is killed, and
    the launcher reads the server's own exit code; stop() reports SIGTERM the same way, and a
    server killed by a signal (SIGKILL, SIGUSR2) reads as that signal."""
    from megatron_gspo.rollout.sglang.launch import ServerProcess

    pid_file = tmp_path / "helper.pid"
    p = ServerProcess(_server_argv(pid_file, 60, 1.0), "server")
    helper = []
    try:
        assert p.proc.wait(timeout=60) == 3
        helper.append(int(pid_file.read_text()))
        assert _gone(helper) == [], "the exited server's helper is left"
        q = ServerProcess([sys.executable, "-c", "import time; time.sleep(300)"], "server")
        time.sleep(0.5)
        q.stop(grace_s=10)
        assert q.returncode == -signal.SIGTERM
        for sig in (signal.SIGKILL, signal.SIGUSR2):  # the server alone dies by a signal
            r = ServerProcess([sys.executable, "-c", "import time; time.sleep(300)"], "server")
            deadline = time.monotonic() + 30
            while not psutil.Process(r.proc.pid).children():
                assert time.monotonic() < deadline, "the server never started"
                time.sleep(0.05)
            os.kill(psutil.Process(r.proc.pid).children()[0].pid, sig)
            assert r.proc.wait(timeout=30) == -sig
    finally:
        _kill_all(helper)


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
