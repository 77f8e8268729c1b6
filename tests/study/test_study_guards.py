"""`megatron-gspo study` and its arms' processes: a study holds a lock on its --out (a second
study into it is refused with one line), a rerun marks an arm that trained to its end done
(not failed, not rerun), and kill -9 of the study takes the arm's trainer with it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_gspo.study import arms as study_mod
from megatron_gspo.runtime.rundir import RunError
from megatron_gspo.study import arm_configs, load_study, run_study
from tests.study.test_study import ROOT, _cli, _env, _fake_arm, _study


def _no_training(*_a, **_k):
    raise AssertionError("an arm was trained")


def test_two_studies_into_one_out_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(study_mod, "_run_arm", _no_training)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time\n"
                               "from megatron_gspo.runtime.rundir import RunDirLock\n"
                               f"RunDirLock({str(out)!r}).acquire(); print('held', flush=True); "
                               "time.sleep(120)"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunError, match=f"run dir {out} is in use by pid {holder.pid}") as e:
            run_study(_study(tmp_path, 2, arms={"a": []}), out, log=lambda _l: None)
        assert "\n" not in str(e.value)
    finally:
        holder.kill()
        holder.wait()


def test_rerun_marks_an_arm_that_trained_to_its_end_done(tmp_path, monkeypatch):
    monkeypatch.setattr(study_mod, "_run_arm", _no_training)
    path = _study(tmp_path, 3, arms={"a": []})
    spec, base = load_study(path)
    (ovr, _), = arm_configs(spec, base, path).values()
    arm = tmp_path / "out" / "a"
    _fake_arm(arm, 0.1, steps=3)
    (arm / "checkpoints" / "step_00000003").mkdir(parents=True)
    (arm / "checkpoints" / "step_00000003" / "COMPLETE").write_text("")
    (arm / "study_arm.json").write_text(json.dumps({"overrides": ovr, "status": "running",
                                                    "attempts": []}))
    lines = []
    run_study(path, tmp_path / "out", log=lines.append)
    assert json.loads((arm / "study_arm.json").read_text())["status"] == "done"
    assert any("arm a: finished earlier" in ln for ln in lines), lines


@pytest.mark.slow
def test_kill_9_of_the_study_takes_the_arm_with_it_and_the_rerun_finishes(tmp_path):
    path = _study(tmp_path, 3, arms={"a": []})
    out = tmp_path / "out"
    proc = subprocess.Popen(_cli(path, out), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    marker = out / "a" / "checkpoints" / "step_00000001" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the arm never saved its first checkpoint"
    trainer = json.loads((out / "a" / "run.lock").read_text())["pid"]
    os.kill(proc.pid, signal.SIGKILL)  # the study only, not its process group
    proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(trainer, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(trainer, signal.SIGKILL)
        pytest.fail(f"the arm's trainer (pid {trainer}) outlived the killed study")
    r = subprocess.run(_cli(path, out), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "a" / "study_arm.json").read_text())["status"] == "done"
