"""Chaos run of the tiny demo: kill -9 at random points and inside the checkpoint
rename/COMPLETE window, a second writer, a damaged newest checkpoint, NaN steps, kill -9 of
an asynchronous run, kill -9 of a study in the middle of its arm (its trainer must die too).
After each injection the run is resumed to the end and must give the metrics of an undisturbed
run (every non-timing value of every metrics.jsonl row, bit for bit), and nothing that looks
complete may be wrong (every checkpoint with COMPLETE verifies, its trainer.json names its
step; no lock left behind). An asynchronous run's numbers depend on timing: only its steps,
checkpoints, lock and processes are checked. `kill_python_tool` kills an agent run (the
multi-turn demo with the python tool) with -9 in the middle of a python tool call: no process
of the run may be left, and the next sandbox made removes the call's temp dir and cgroup.

    python tests/loop/chaos.py --rounds 10 --seed 0 [--workdir DIR] [--model DIR] [--kinds a,b]

Prints the counts (injections per kind, resumes, mismatches, violations); exit code 1 on any
mismatch or violation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron_gspo.runtime.run_checkpoint import Checkpointer, verify  # noqa: E402

CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
STEPS = 6
NAN_STEP = 3
SETTINGS = [f"train.max_steps={STEPS}", "checkpoint.interval=1", "checkpoint.keep_last=2",
            "train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
            "algorithm.mini_batches=2", "logging.progress_bar=false",
            "logging.tensorboard=false", "train.eval_interval=0", "logging.log_samples=0",
            "precision.audit_fraction=0.5"]
TIMING = ("time", "time/", "tokens_per_s", "time_fwd_bwd", "time_optimizer")
KINDS = ("kill_random", "kill_window", "second_writer", "corrupt_newest", "nan_step",
         "kill_python_tool", "async_kill", "study_kill")
ASYNC = ["rollout.mode=async", "rollout.max_staleness=1"]
AGENT_CONFIG = ROOT / "examples" / "multiturn_agent" / "config_cpu.yaml"
AGENT_SETTINGS = ["agent.environment=tests/agent/sleepy_python_env.py:SleepyPythonEnv",
                  "agent.python_tool=true", "train.max_steps=1", "train.prompts_per_step=1",
                  "rollout.group_size=2", "train.eval_interval=0", "logging.tensorboard=false"]


class Chaos:
    """Runs the injections and keeps the counts."""

    def __init__(self, workdir: Path, model: str | None, seed: int):
        self.work = workdir
        self.model = model
        self.rng = random.Random(seed)
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self.refs: dict[str, dict] = {}
        self.ref_time = 30.0

    # ------------------------------------------------------------------ running the demo
    def _cmd(self, run: Path) -> list[str]:
        extra = [f"model.path={self.model}"] if self.model else []
        return [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir",
                str(run), *SETTINGS, *extra]

    def _env(self, fault: str = "") -> dict:
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        env.pop("MEGATRON_GSPO_FAULT", None)
        if fault:
            env["MEGATRON_GSPO_FAULT"] = fault
        return env

    def start(self, run: Path, fault: str = "", extra: tuple = ()) -> subprocess.Popen:
        return subprocess.Popen(self._cmd(run) + list(extra), cwd=ROOT, env=self._env(fault),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def finish(self, run: Path, fault: str = "", resume: bool = True, extra: tuple = ()) -> float:
        """Run (or resume) to the end; returns the wall time (a failure is a problem)."""
        t0 = time.time()
        p = self.start(run, fault, extra)
        _, err = p.communicate(timeout=900)
        if resume:
            self.counts["resumes"] += 1
        if p.returncode != 0:
            self.problems.append(f"{run.name}: exit {p.returncode}: {err.strip()[-400:]}")
        return time.time() - t0

    @staticmethod
    def metrics(run: Path) -> dict[int, dict]:
        rows = {}
        path = run / "metrics.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            r = json.loads(line)
            rows[r["step"]] = {k: v for k, v in r.items() if not k.startswith(TIMING)}
        return rows

    def reference(self, fault: str = "") -> dict:
        if fault not in self.refs:
            run = self.work / f"ref{len(self.refs)}"
            took = self.finish(run, fault, resume=False)
            self.ref_time = took if not fault else self.ref_time
            self.refs[fault] = self.metrics(run)
        return self.refs[fault]

    # ------------------------------------------------------------------ checks
    def check(self, run: Path, fault: str = "") -> None:
        ref, got = self.reference(fault), self.metrics(run)
        if sorted(got) != list(range(STEPS)):
            self.counts["mismatches"] += 1
            self.problems.append(f"{run.name}: metrics steps {sorted(got)}")
        for step in range(STEPS):
            if step in got and got[step] != ref.get(step):
                self.counts["mismatches"] += 1
                diff = [k for k in set(got[step]) | set(ref.get(step, {}))
                        if got[step].get(k) != ref.get(step, {}).get(k)]
                self.problems.append(f"{run.name}: step {step} differs in {sorted(diff)[:6]}")
        self.check_complete(run)
        if (run / "run.lock").exists():
            self.counts["violations"] += 1
            self.problems.append(f"{run.name}: run.lock left after a clean exit")

    def check_complete(self, run: Path) -> None:
        for step, path in Checkpointer(run / "checkpoints").complete():
            problem = verify(path)
            state = json.loads((path / "trainer.json").read_text()) if problem is None else {}
            if problem or state.get("step") != step:
                self.counts["violations"] += 1
                self.problems.append(f"{run.name}: complete-looking {path.name} is wrong: "
                                     f"{problem or state.get('step')}")

    def _wait_for(self, p: subprocess.Popen, path: Path, timeout: float = 600) -> bool:
        deadline = time.time() + timeout
        while not path.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        return path.exists()

    def _kill(self, p: subprocess.Popen) -> bool:
        if p.poll() is not None:
            return False
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        return True

    # ------------------------------------------------------------------ injections
    def kill_random(self, run: Path) -> None:
        for _ in range(self.rng.randint(1, 2)):
            p = self.start(run)
            time.sleep(self.rng.uniform(0.2, 1.0) * self.ref_time)
            if self._kill(p):
                self.counts["kill_random"] += 1
            self.check_complete(run)
        self.finish(run)
        self.check(run)

    def kill_window(self, run: Path) -> None:
        points = ["kill_before_complete", "kill_before_rename"]  # alternate: both windows
        point = points[sum(self.counts[f"kill_window:{p}"] for p in points) % 2]
        step = self.rng.randint(1, STEPS)
        p = self.start(run, f"{point}@{step}")
        p.communicate(timeout=900)
        if p.returncode != -signal.SIGKILL:
            self.problems.append(f"{run.name}: {point}@{step} did not fire ({p.returncode})")
        self.counts[f"kill_window:{point}"] += 1
        if step in [s for s, _ in Checkpointer(run / "checkpoints").complete()]:
            self.counts["violations"] += 1
            self.problems.append(f"{run.name}: step {step} looks complete after {point}")
        self.check_complete(run)
        self.finish(run)
        self.check(run)

    def second_writer(self, run: Path) -> None:
        a = self.start(run)
        if not self._wait_for(a, run / "run.lock"):
            self.problems.append(f"{run.name}: first writer never took the lock")
        b = subprocess.run(self._cmd(run), cwd=ROOT, env=self._env(), capture_output=True,
                           text=True, timeout=600)
        lines = [ln for ln in b.stderr.splitlines() if ln.startswith("megatron-gspo:")]
        self.counts["second_writer"] += 1
        if b.returncode != 2 or len(lines) != 1 or f"pid {a.pid}" not in lines[0]:
            self.counts["violations"] += 1
            self.problems.append(f"{run.name}: second writer not refused: {b.returncode} "
                                 f"{b.stderr.strip()[-300:]}")
        _, err = a.communicate(timeout=900)
        if a.returncode != 0:
            self.problems.append(f"{run.name}: first writer failed: {err.strip()[-300:]}")
        self.check(run)

    def corrupt_newest(self, run: Path) -> None:
        step = self.rng.randint(2, STEPS - 1)
        p = self.start(run)
        self._wait_for(p, run / "checkpoints" / f"step_{step:08d}" / "COMPLETE")
        self._kill(p)
        newest = Checkpointer(run / "checkpoints").latest()
        if newest is None:
            self.problems.append(f"{run.name}: no checkpoint to damage")
            return
        files = sorted((f for f in (newest[1] / "model").rglob("*") if f.is_file()),
                       key=lambda f: f.stat().st_size)
        target = files[-1]
        data = bytearray(target.read_bytes())
        how = self.rng.choice(["flip", "truncate"])
        if how == "flip":  # same size, different bytes
            at = self.rng.randrange(len(data))
            data[at] ^= 0x5A
            target.write_bytes(bytes(data))
        else:
            target.write_bytes(bytes(data[: len(data) // 2]))
        self.counts[f"corrupt_newest:{how}"] += 1
        self.finish(run)
        if "moved aside" not in (run / "events.log").read_text():
            self.counts["violations"] += 1
            self.problems.append(f"{run.name}: damaged {newest[1].name} not reported")
        self.check(run)

    def nan_step(self, run: Path) -> None:
        fault = f"nan_loss@{NAN_STEP}"
        p = self.start(run, fault)
        time.sleep(self.rng.uniform(0.3, 1.0) * self.ref_time)
        if self._kill(p):
            self.counts["kill_random"] += 1
        self.counts["nan_step"] += 1
        self.finish(run, fault)
        self.check(run, fault)
        rows = self.metrics(run)
        clean = self.reference()
        bad = rows.get(NAN_STEP, {})
        if bad.get("update_skipped") != 2.0 or bad.get("loss") is not None or any(
                rows[s].get("update_skipped") for s in rows if s != NAN_STEP):
            self.counts["violations"] += 1
            self.problems.append(f"{run.name}: NaN step not skipped/counted: {bad}")
        if any(rows[s] != clean[s] for s in range(NAN_STEP)):  # before the NaN: as undisturbed
            self.counts["mismatches"] += 1
            self.problems.append(f"{run.name}: steps before the NaN step differ")

    def kill_python_tool(self, run: Path) -> None:
        import psutil

        from megatron_gspo.agent.tools import sandbox_cgroup, sandbox_os

        extra = [f"model.path={self.model}"] if self.model else []
        p = subprocess.Popen([sys.executable, "-m", "megatron_gspo.cli", "train",
                              str(AGENT_CONFIG), "--run-dir", str(run), *AGENT_SETTINGS, *extra],
                             cwd=ROOT, env=self._env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        procs, deadline = [], time.time() + 600
        while not procs and p.poll() is None and time.time() < deadline:
            try:
                kids = psutil.Process(p.pid).children(recursive=True)
                if any("_landlock" in " ".join(k.cmdline()) for k in kids):
                    time.sleep(0.3)
                    procs = psutil.Process(p.pid).children(recursive=True)
            except psutil.Error:
                pass
            time.sleep(0.1)
        if not self._kill(p) or not procs:
            self.problems.append(f"{run.name}: no python tool call to kill in ({p.returncode})")
            return
        self.counts["kill_python_tool"] += 1
        time.sleep(2.0)
        left = [q.pid for q in procs if q.is_running() and q.status() != psutil.STATUS_ZOMBIE]
        if left:
            self.counts["violations"] += 1
            self.problems.append(f"{run.name}: {len(left)} processes of the tool call left")
        self.counts["python_tool_processes_killed"] += len(procs)
        roots = (tempfile.gettempdir(), sandbox_os.PIDS_ROOT, *sandbox_cgroup.parents().values())
        traces = [f"{root}/{n}" for root in roots
                  if os.path.isdir(root)
                  for n in os.listdir(root) if n.startswith(sandbox_os.owner_tag(p.pid))]
        sandbox_os.sweep_stale()
        if any(os.path.exists(t) for t in traces):
            self.counts["violations"] += 1
            self.problems.append(f"{run.name}: temp dirs/cgroups of the call not swept")

    def async_kill(self, run: Path) -> None:
        """kill -9 of an asynchronous run (generation overlapping training), then resume:
        every step trained once, complete checkpoints verify, no lock or process left. The
        numbers depend on the overlap's timing, so they are not compared with a reference."""
        for _ in range(self.rng.randint(1, 2)):
            p = self.start(run, extra=ASYNC)
            step = self.rng.randint(1, STEPS - 1)  # mid-run: after a checkpoint, not by time
            self._wait_for(p, run / "checkpoints" / f"step_{step:08d}" / "COMPLETE")
            time.sleep(self.rng.uniform(0.0, 2.0))
            pids = self._run_pids(run)
            if self._kill(p):
                self.counts["async_kill"] += 1
            else:
                self.problems.append(f"{run.name}: the async run ended before the kill")
            self._check_gone(run, pids)
            self.check_complete(run)
        self.finish(run, extra=ASYNC)
        steps = sorted(self.metrics(run))
        if steps != list(range(STEPS)):
            self.counts["mismatches"] += 1
            self.problems.append(f"{run.name}: async metrics steps {steps}")
        self.check_complete(run)
        if (run / "run.lock").exists():
            self.counts["violations"] += 1
            self.problems.append(f"{run.name}: run.lock left after a clean exit")

    def study_kill(self, run: Path) -> None:
        """kill -9 of `megatron-gspo study` (the study only) in the middle of its arm: the
        arm's trainer must die with it; the rerun finishes the arm, marks it done, and its
        metrics equal the undisturbed run's."""
        extra = [f"model.path={self.model}"] if self.model else []
        run.mkdir(parents=True, exist_ok=True)
        study = run / "study.yaml"
        study.write_text(f"base: {CONFIG}\noverrides: {json.dumps(SETTINGS + extra)}\n"
                         "arms:\n  a: []\n")
        cmd = [sys.executable, "-m", "megatron_gspo.cli", "study", str(study), "--out",
               str(run / "out")]
        p = subprocess.Popen(cmd, cwd=ROOT, env=self._env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        arm = run / "out" / "a"
        step = self.rng.randint(1, STEPS - 1)
        self._wait_for(p, arm / "checkpoints" / f"step_{step:08d}" / "COMPLETE")
        time.sleep(self.rng.uniform(0.0, 2.0))
        pids = self._run_pids(arm)
        if self._kill(p):
            self.counts["study_kill"] += 1
            self._check_gone(arm, pids)
        else:
            self.problems.append(f"{run.name}: the study ended before the kill")
        r = subprocess.run(cmd, cwd=ROOT, env=self._env(), capture_output=True, text=True,
                           timeout=900)
        self.counts["resumes"] += 1
        if r.returncode != 0:
            self.problems.append(f"{run.name}: study rerun exit {r.returncode}: "
                                 f"{r.stderr.strip()[-400:]}")
        state = json.loads((arm / "study_arm.json").read_text()) \
            if (arm / "study_arm.json").exists() else {}
        if state.get("status") != "done":
            self.counts["violations"] += 1
            self.problems.append(f"{run.name}: arm status {state.get('status')} after rerun")
        self.check(arm)

    @staticmethod
    def _run_pids(run: Path) -> list[int]:
        """The trainer holding `run`'s lock and every process below it."""
        try:
            top = int(json.loads((run / "run.lock").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return []
        out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True)
        kids: dict[int, list[int]] = {}
        for line in out.stdout.splitlines():
            pid, ppid = map(int, line.split())
            kids.setdefault(ppid, []).append(pid)
        found, todo = [], [top]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += kids.get(pid, [])
        return found

    def _check_gone(self, run: Path, pids: list[int], timeout: float = 30.0) -> None:
        """Every process of a killed run ends within `timeout` (a survivor is a violation and
        is killed here)."""
        deadline = time.time() + timeout
        alive = list(pids)
        while alive and time.time() < deadline:
            alive = [pid for pid in alive if _alive(pid)]
            time.sleep(0.1)
        if alive:
            self.counts["violations"] += 1
            self.problems.append(f"{run.name}: processes {alive} outlived the kill")
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def run(self, rounds: int, only: tuple[str, ...] = KINDS) -> int:
        self.reference()
        kinds = [only[i % len(only)] for i in range(rounds)]
        self.rng.shuffle(kinds)
        for i, kind in enumerate(kinds):
            t0 = time.time()
            before = len(self.problems)
            getattr(self, kind)(self.work / f"r{i:02d}_{kind}")
            status = "ok" if len(self.problems) == before else "; ".join(self.problems[before:])
            print(f"round {i} {kind}: {time.time() - t0:.0f}s {status}", flush=True)
        injections = {k: v for k, v in sorted(self.counts.items())
                      if k not in ("resumes", "mismatches", "violations")}
        print("injections: " + json.dumps(injections))
        print(f"resumes: {self.counts['resumes']}  mismatches: {self.counts['mismatches']}  "
              f"violations: {self.counts['violations']}  problems: {len(self.problems)}")
        return 1 if self.problems else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=len(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    ap.add_argument("--model", default=None, help="model.path (default: the config's)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated injection kinds")
    args = ap.parse_args(argv)
    only = tuple(k for k in args.kinds.split(",") if k)
    unknown = sorted(set(only) - set(KINDS))
    if unknown:
        ap.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="chaos_"))
    work.mkdir(parents=True, exist_ok=True)
    return Chaos(work, args.model, args.seed).run(args.rounds, only)


if __name__ == "__main__":
    sys.exit(main())
