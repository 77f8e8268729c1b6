"""runtime/restarts.py: what a torchrun-restarted round records and when it stops the job."""

import json

import pytest

from megatron_gspo.runtime import restarts
from megatron_gspo.runtime.restarts import RepeatedFailure, RestartRecord


def _round(monkeypatch, n: int, max_restarts: int = 5) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(n))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(max_restarts))


def _metrics(run_dir, steps) -> None:
    rows = [json.dumps({"step": s, "loss": 0.1}) for s in steps]
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 9')  # a cut row


def test_a_restarted_round_records_the_failed_step_and_cause(tmp_path, monkeypatch):
    _round(monkeypatch, 0)
    RestartRecord(tmp_path).begin()
    _metrics(tmp_path, range(4))
    monkeypatch.setenv("RANK", "1")
    restarts.note_error(tmp_path, RuntimeError("Connection closed by peer [127.0.0.1]:5"))
    restarts.note_error(tmp_path, ValueError("bad sample 7"))  # a real error beats a symptom
    restarts.note_error(tmp_path, RuntimeError("second"))  # the first real one stays
    _round(monkeypatch, 1)
    note = RestartRecord(tmp_path).begin().note
    assert note.startswith("automatic restart 1 of 5 (torchrun): step 4 failed (rank 1: "
                           "ValueError: bad sample 7)")
    rec = json.loads((tmp_path / "restarts.json").read_text())
    assert [(f["round"], f["step"]) for f in rec["failures"]] == [(0, 4)]


def test_a_kill_without_an_error_is_named(tmp_path, monkeypatch):
    _round(monkeypatch, 0)
    RestartRecord(tmp_path).begin()
    restarts.note_error(tmp_path, RuntimeError("Connection reset by peer"))
    _round(monkeypatch, 1)
    note = RestartRecord(tmp_path).begin().note
    assert "step 0 failed (no error was recorded: a process was killed" in note
    assert "rank 0 then lost its peer" in note


def test_the_third_failure_at_one_step_stops_every_later_round(tmp_path, monkeypatch):
    _round(monkeypatch, 0)
    RestartRecord(tmp_path).begin()
    _metrics(tmp_path, range(2))
    for n in (1, 2):
        _round(monkeypatch, n)
        RestartRecord(tmp_path).begin()
    _round(monkeypatch, 3)
    with pytest.raises(RepeatedFailure, match=r"^step 2 failed 3 times in a row under "
                       r"torchrun restarts, last cause: no error was recorded"):
        RestartRecord(tmp_path).begin()
    _metrics(tmp_path, range(3))  # whatever happened since: the job stays stopped
    _round(monkeypatch, 4)
    with pytest.raises(RepeatedFailure, match="^step 2 failed 3 times"):
        RestartRecord(tmp_path).begin()
    _round(monkeypatch, 0)  # a new launch (a person fixed the cause) starts a fresh record
    assert RestartRecord(tmp_path).begin().note == ""
    assert json.loads((tmp_path / "restarts.json").read_text()) == {
        "failures": [], "stopped": None, "fresh_start": True}


def test_a_restart_before_the_first_checkpoint_starts_over(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    _round(monkeypatch, 0)
    RestartRecord(tmp_path).begin(ckpt)
    _metrics(tmp_path, range(2))
    _round(monkeypatch, 1)
    rec = RestartRecord(tmp_path).begin(ckpt)
    assert rec.start_over and rec.starting_over(ckpt) and "starting over" in rec.note
    (ckpt / "step_00000002").mkdir(parents=True)
    (ckpt / "step_00000002" / "COMPLETE").write_text("{}")
    assert not RestartRecord(tmp_path).starting_over(ckpt)  # then it resumes as usual
    _round(monkeypatch, 0)  # a job started on a run with checkpoints never starts over
    RestartRecord(tmp_path).begin(ckpt)
    (ckpt / "step_00000002" / "COMPLETE").unlink()
    _round(monkeypatch, 1)
    assert not RestartRecord(tmp_path).starting_over(ckpt)


def test_failures_at_different_steps_do_not_stop(tmp_path, monkeypatch):
    _round(monkeypatch, 0)
    RestartRecord(tmp_path).begin()
    for n, done in enumerate((2, 2, 3, 3, 4), start=1):
        _metrics(tmp_path, range(done))
        _round(monkeypatch, n, max_restarts=9)
        RestartRecord(tmp_path).begin()


def test_without_torchrun_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restarts.restart_round() == 0
    RestartRecord(tmp_path).begin()
    restarts.note_error(tmp_path, RuntimeError("x"))
    assert list(tmp_path.iterdir()) == []


def test_a_fault_with_a_round_fires_only_in_that_round(monkeypatch):
    from megatron_gspo.runtime import faults

    monkeypatch.setenv(faults.ENV, "kill_rank1_in_sync@3#0,kill_at_step@2")
    _round(monkeypatch, 0)
    assert faults.active("kill_rank1_in_sync", 3) and faults.active("kill_at_step", 2)
    assert not faults.active("kill_rank1_in_sync", 2)
    _round(monkeypatch, 1)  # a restarted round: only the items without '#N' fire again
    assert not faults.active("kill_rank1_in_sync", 3) and faults.active("kill_at_step", 2)


def test_a_round_that_died_while_starting_is_still_counted(tmp_path, monkeypatch):
    """A group killed during its start-up (before its own `begin`) leaves no line; the next
    round records it too, so the same-step stop counts every failed round."""
    _round(monkeypatch, 0)
    RestartRecord(tmp_path).begin()
    _metrics(tmp_path, range(2))
    _round(monkeypatch, 2)  # round 1 died before it recorded round 0's failure
    note = RestartRecord(tmp_path).begin().note
    assert note.startswith("automatic restart 2 of 5 (torchrun): step 2 failed")
    rec = json.loads((tmp_path / "restarts.json").read_text())
    assert [(f["round"], f["step"]) for f in rec["failures"]] == [(0, 2), (1, 2)]
    assert rec["failures"][0]["cause"] == restarts.STARTUP_KILLED
    _round(monkeypatch, 3)  # the third failure at step 2 stops the job
    with pytest.raises(RepeatedFailure, match="^step 2 failed 3 times"):
        RestartRecord(tmp_path).begin()
