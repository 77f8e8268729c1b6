"""Automatic restarts under torchrun's elastic agent (`--max-restarts`), seen from the run dir.

torchrun restarts the whole worker group when a rank dies; it exports the round number as
TORCHELASTIC_RESTART_COUNT (0 for the first group) and TORCHELASTIC_MAX_RESTARTS. There is no
supervisor of our own: a restarted group runs the same command, and this module makes it
continue the run instead of refusing it or starting over, and stops a run that fails at the
same step again and again.

- `restart_round()`: the round (0 without torchrun).
- `die_with_agent()`: a worker ends when its torchrun agent dies (also by kill -9).
- `RestartRecord.begin` (the writing rank, holding the run-dir lock): in round 0 it starts a
  fresh `RUN_DIR/restarts.json`; in a restarted round it records the failed step (the first
  step the dead group did not log in metrics.jsonl) and its cause (the first error a rank of
  that round wrote with `note_error`, else "killed": kill -9, the OOM killer, a lost node),
  and raises RunError, one line naming the step and the cause, once the same step has failed
  `SAME_STEP_FAILURES` times in a row; every later round of the job refuses with that line
  too, so torchrun's remaining restarts end in seconds instead of repeating the step.
- `check_checkpoint_interval`: refuses at start a job torchrun may restart
  (TORCHELASTIC_MAX_RESTARTS > 0) whose only checkpoint is the last (`checkpoint.interval: 0`,
  the default): every restart would start over at step 0.
- `note_error(run_dir, exc)`: any rank; the first error of a round is kept (`last_error.json`),
  one that only says a peer went away (`PEER_LOST`) gives way to a real one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megatron_gspo.runtime.exec_with_parent import die_with_parent
from megatron_gspo.runtime.rundir import RunError

__all__ = ["SAME_STEP_FAILURES", "RepeatedFailure", "RestartRecord", "restart_round",
           "max_restarts", "check_checkpoint_interval", "note_error", "die_with_agent"]

SAME_STEP_FAILURES = 3  # the third failure at one step stops the job
RECORD = "restarts.json"
LAST_ERROR = "last_error.json"
# what a rank sees when another rank of its group died (gloo, NCCL, the store)
PEER_LOST = ("closed by peer", "reset by peer", "Connection refused", "Broken pipe",
             "remote process exited", "NCCL communicator was aborted", "Socket Timeout")
STARTUP_KILLED = ("not recorded: the group restarted after it died during its start-up, "
                  "before it could record this failure")
KILLED = ("no error was recorded: a process was killed (kill -9, the OOM killer, a lost node) "
          "or ended without a Python error")


class RepeatedFailure(RunError):
    """The same step failed SAME_STEP_FAILURES times in a row under torchrun restarts."""


def restart_round() -> int:
    """The torchrun restart round of this worker group (0: first group, or no torchrun)."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def die_with_agent() -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set): the kernel kills this worker when its elastic
    agent dies. The agent stops its workers when it is stopped (SIGTERM, SIGINT), but an agent
    killed with -9 or crashed leaves them running, holding their ports and accelerators; with
    this they end, and their launched servers and writer helpers with them (each tied to its
    own launcher). torchrun's agent starts its workers from its main thread, the thread the
    kernel watches (`exec_with_parent`)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(os.getppid())


def max_restarts() -> int:
    """torchrun's `--max-restarts` (0 without torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return 0


def check_checkpoint_interval(interval: int, max_steps: int) -> None:
    """RunError (one line) when torchrun may restart this job (`--max-restarts` > 0: the
    worker environment's TORCHELASTIC_MAX_RESTARTS, set by torch's local elastic agent) but
    `checkpoint.interval` is 0 (a checkpoint only at the end): every automatic restart would
    start over at step 0. Refused, not warned: a warning is read after the steps are lost,
    and the interval is a choice of what a checkpoint costs against what a failure may."""
    n = max_restarts()
    if n > 0 and interval == 0 and max_steps > 1:
        raise RunError(f"checkpoint.interval: 0 (a checkpoint only at the end of "
                       f"{max_steps} steps), but torchrun restarts this job up to {n} times "
                       f"(--max-restarts {n}): every restart would start over at step 0; set "
                       "checkpoint.interval=N (a restart then redoes at most N steps), or "
                       "run torchrun with --max-restarts 0 (MAX_RESTARTS=0 for "
                       "docker/launch/*.sh)")


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
        return obj if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}


def note_error(run_dir: str | os.PathLike, exc: BaseException) -> None:
    """Keep `exc` as the cause of this round's failure (the first one written wins); only
    under torchrun, where a next round reads it. Never raises."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    rank = os.environ.get("RANK", "0")
    text = " ".join(str(exc).split())
    lost = any(p in text for p in PEER_LOST)  # a symptom: another rank died first
    line = f"{type(exc).__name__}: {text}"[:300]
    path = Path(run_dir) / LAST_ERROR
    try:
        old = _read_json(path)
        if old.get("round") == restart_round() and (lost or not old.get("peer_lost")):
            return
        _write_json(path, {"round": restart_round(), "rank": rank, "error": line,
                           "peer_lost": lost})
    except OSError:
        pass


def _cause(err: dict, rnd: int) -> str:
    """The cause of round `rnd - 1`'s failure, from its `last_error.json`."""
    if err.get("round") != rnd - 1 or not err.get("error"):
        return KILLED
    if err.get("peer_lost"):
        return f"{KILLED}; rank {err.get('rank', '?')} then lost its peer"
    return f"rank {err.get('rank', '?')}: {err.get('error')}"


def _failed_step(run_dir: Path) -> int:
    """The first step the dead group did not log (metrics.jsonl, written after each step)."""
    last = -1
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            last = max(last, int(json.loads(line).get("step", -1)))
        except (ValueError, AttributeError, TypeError):
            continue  # a row cut short by the kill
    return last + 1


def _complete(ckpt_root) -> bool:
    """True when `ckpt_root` holds a checkpoint with its COMPLETE marker."""
    root = Path(ckpt_root) if ckpt_root is not None else None
    return bool(root and root.is_dir() and any(
        (p / "COMPLETE").is_file() for p in root.glob("step_*")))


class RestartRecord:
    """`RUN_DIR/restarts.json`: the failures of this torchrun job, one per restarted round.

    Args:
        run_dir: the run directory (the caller holds its lock).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RECORD
        self.note = ""  # the event line of a restarted round
        self.start_over = False  # restarted before the job's first checkpoint

    def starting_over(self, ckpt_root: str | os.PathLike) -> bool:
        """True in a restarted round of a job that started from the initial weights and died
        before its first checkpoint: it starts over (metrics.jsonl rewritten from step 0)
        instead of refusing a run dir with metrics and no checkpoint. Any rank may ask."""
        return (restart_round() > 0 and bool(_read_json(self.path).get("fresh_start"))
                and not _complete(ckpt_root))

    def begin(self, ckpt_root: str | os.PathLike | None = None) -> "RestartRecord":
        """Record this round's start (see the module docstring).

        Raises:
            RepeatedFailure: the same step failed SAME_STEP_FAILURES times in a row (or an earlier
                round of this job stopped for that reason).
        """
        rnd = restart_round()
        if rnd == 0:
            if "TORCHELASTIC_RESTART_COUNT" in os.environ or self.path.exists():
                _write_json(self.path, {"failures": [], "stopped": None,
                                        "fresh_start": not _complete(ckpt_root)})
            return self
        rec = _read_json(self.path)
        self.start_over = self.starting_over(ckpt_root)
        rec.setdefault("failures", [])
        if rec.get("stopped"):
            raise RepeatedFailure(rec["stopped"])
        err = _read_json(self.run_dir / LAST_ERROR)
        cause = _cause(err, rnd)
        step = _failed_step(self.run_dir)
        done = [f.get("round", -1) for f in rec["failures"]]
        # a group that died while it started recorded nothing: its predecessor's failure too
        for lost in range(max(done, default=-1) + 1, rnd - 1):
            rec["failures"].append({"round": lost, "step": step, "cause": STARTUP_KILLED,
                                    "time": time.time()})
        rec["failures"].append({"round": rnd - 1, "step": step, "cause": cause,
                                "time": time.time()})
        same = 0
        for f in reversed(rec["failures"]):
            if f.get("step") != step:
                break
            same += 1
        self.note = (f"automatic restart {rnd} of {max_restarts()} (torchrun): step {step} "
                     f"failed ({cause}); " + ("no checkpoint yet: starting over from the "
                                              "initial weights" if self.start_over else
                                              "resuming from the newest complete checkpoint"))
        if same >= SAME_STEP_FAILURES:
            rec["stopped"] = (f"step {step} failed {same} times in a row under torchrun "
                              f"restarts, last cause: {cause}; stopping instead of restarting "
                              f"again: fix the cause, then launch again (train.resume=auto "
                              f"continues from the newest checkpoint)")
        _write_json(self.path, rec)
        if rec.get("stopped"):
            raise RepeatedFailure(rec["stopped"])
        return self
