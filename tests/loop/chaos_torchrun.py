"""Chaos under a real `torchrun --nproc_per_node 2 --max-restarts N` of the tiny demo (TP2,
deterministic, a checkpoint every step): kill -9 of rank 1 or rank 0 at a random point of a
random step (so also inside a weight sync or a checkpoint save), and no person acts: torchrun's
elastic agent restarts the worker group, which resumes from the newest complete checkpoint by
itself. Checked: the job exits 0, every metrics row equals an uninterrupted torchrun run's
(every non-timing value), every checkpoint that says COMPLETE verifies, no run.lock and no
process of the job (torchrun, ranks of every round, their children) is left. The `servers_`
kinds do the same with two launched (colocated) stand-in SGLang servers: the dead group's
servers end with it (their launcher's death) and the restarted group launches new ones on the
same ports. Deterministic mode gives every sample its own sampling seed and launches the servers
with --enable-deterministic-inference, so what a sample draws does not depend on the server,
its batch or a restart: every row is compared there too. `repeat` makes rank 1 die at the same
step in every round: the job must stop with one line naming the step. The `async_` kinds save
asynchronously (checkpoint.async_save) and kill inside a save: right after its `.tmp_step_*`
folder appears, while the forked writers write or before the save is finalized. The `sync_`
kinds kill inside a weight sync, targeted (`kill_rank<R>_in_sync@V#N`, runtime/faults.py): once the
first of the stream's buckets (1 MiB each) reached the engine, so the engine holds part of the
update; `servers_sync_` the same with the stand-in servers, which then hold a mix of two weight
versions and must not outlive their group (the restarted group starts and fully syncs new ones).

    python tests/loop/chaos_torchrun.py --rounds 10 --seed 0 [--kinds kill_rank1,kill_rank0]

Prints one line per round and the counts (injections per kind, automatic restarts,
mismatches, leftovers, violations); exit code 1 on any problem.
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
sys.path.insert(0, str(Path(__file__).parent))

import chaos  # noqa: E402  (the settings and the checks of the single-process chaos)

KINDS = ("kill_rank1", "kill_rank0", "servers_kill_rank1", "servers_kill_rank0",
         "async_kill_rank1", "async_kill_rank0", "sync_kill_rank1", "sync_kill_rank0",
         "servers_sync_kill_rank1", "servers_sync_kill_rank0", "repeat")
SYNC = ("rollout.bucket_bytes=1048576",)  # several buckets: a kill lands mid-stream
ASYNC_SAVE = ("checkpoint.async_save=true",)
SERVERS = ["rollout.engine=sglang", "rollout.colocate=true", "rollout.num_servers=2",
           "rollout.startup_timeout=240"]
SERVERS_ENV = {"SGLANG_SERVER_MODULE": "megatron_gspo.rollout.standin.server"}
RUN_TIMEOUT = 420.0  # seconds a whole job may take (a hang is a failure)


def torchrun_cmd(run: Path, steps: int, max_restarts: int, extra=()) -> list[str]:
    """The documented single-node command, on the tiny demo with TP2."""
    settings = [s for s in chaos.SETTINGS if not s.startswith("train.max_steps=")]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node=2", f"--max-restarts={max_restarts}", "--monitor-interval=1",
            "-m", "megatron_gspo.cli", "train", str(chaos.CONFIG), "--run-dir", str(run),
            f"train.max_steps={steps}", "parallel.tensor=2", "train.deterministic=true",
            *settings, *extra]


class Job:
    """One torchrun job; remembers every process it ever had (for the leftover check)."""

    def __init__(self, run: Path, steps: int, max_restarts: int = 3, fault: str = "",
                 extra: tuple = (), env_extra: dict | None = None):
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **(env_extra or {}))
        env.pop("MEGATRON_GSPO_FAULT", None)
        if fault:
            env["MEGATRON_GSPO_FAULT"] = fault
        self.run = run
        self.err = run.with_suffix(".stderr")
        run.parent.mkdir(parents=True, exist_ok=True)
        self.p = subprocess.Popen(torchrun_cmd(run, steps, max_restarts, extra), cwd=ROOT,
                                  env=env,
                                  stdout=subprocess.DEVNULL, stderr=open(self.err, "w"),
                                  start_new_session=True)
        self.seen: set[int] = {self.p.pid}

    def ranks(self) -> dict[int, int]:
        """RANK -> pid of the current worker group (and every descendant noted in `seen`)."""
        import psutil

        out = {}
        try:
            kids = psutil.Process(self.p.pid).children(recursive=True)
        except psutil.Error:
            return out
        for k in kids:
            self.seen.add(k.pid)
            try:
                env = k.environ()
                if k.ppid() == self.p.pid and "RANK" in env:
                    out[int(env["RANK"])] = k.pid
            except psutil.Error:
                pass
        return out

    def wait_for(self, path: Path, timeout: float = RUN_TIMEOUT) -> bool:
        deadline = time.time() + timeout
        while not path.exists() and self.p.poll() is None and time.time() < deadline:
            self.ranks()
            time.sleep(0.05)
        return path.exists()

    def finish(self, timeout: float = RUN_TIMEOUT) -> int:
        """Wait for the job (killing its session after `timeout`: a hang); its exit code."""
        deadline = time.time() + timeout
        while self.p.poll() is None and time.time() < deadline:
            self.ranks()
            time.sleep(0.2)
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
            return -999
        return self.p.returncode

    def leftovers(self, grace: float = 30.0) -> list[int]:
        """Processes of the job still alive `grace` seconds after it ended (killed here)."""
        deadline = time.time() + grace
        alive = sorted(self.seen)
        while alive and time.time() < deadline:
            alive = [pid for pid in alive if chaos._alive(pid)]  # noqa: SLF001
            time.sleep(0.1)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return alive

    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""


def _in_sync(kind: str) -> bool:
    """A kind that kills inside a weight sync (`sync_`, `servers_sync_`; not `async_`)."""
    return kind.startswith(("sync_", "servers_sync_"))


def kill_rank(job: Job, rank: int, step: int | None, delay: float,
              inside_save: bool = False) -> bool:
    """kill -9 of `rank` `delay` seconds after checkpoint `step` is complete (None: now;
    `inside_save`: once the save of `step` has begun)."""
    if step is not None:
        mark = f".tmp_step_{step:08d}" if inside_save else f"step_{step:08d}/COMPLETE"
        if not job.wait_for(job.run / "checkpoints" / mark):
            return False
    time.sleep(delay)
    pid = job.ranks().get(rank)
    if pid is None or job.p.poll() is not None:
        return False
    os.kill(pid, signal.SIGKILL)
    return True


def _no_counters(rows: dict[int, dict]) -> dict[int, dict]:
    """Rows without the SGLang client's `rollout/engine_*_total` counters: they count since
    the process started (a restarted group's start at 0), like the timings."""
    return {step: {k: v for k, v in row.items()
                   if not (k.startswith("rollout/engine_") and k.endswith("_total"))}
            for step, row in rows.items()}


def failures(run: Path) -> list[dict]:
    """The automatic restarts recorded by the run (runtime/restarts.py)."""
    try:
        return json.loads((run / "restarts.json").read_text()).get("failures", [])
    except (OSError, ValueError):
        return []


class TorchrunChaos:
    """The injections and their counts."""

    def __init__(self, work: Path, seed: int, steps: int = chaos.STEPS):
        self.work, self.steps = work, steps
        self.rng = random.Random(seed)
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self._refs: dict[bool, dict] = {}
        self.port = 31000 + self.rng.randrange(0, 200) * 16  # the servers' base port

    def _variant(self, servers: bool, sync: bool = False) -> dict:
        out = {"extra": SYNC} if sync else {}
        if not servers:
            return out
        self.port += 2
        return {"extra": (*SERVERS, f"rollout.base_port={self.port}", *out.get("extra", ())),
                "env_extra": SERVERS_ENV}

    def reference(self, servers: bool = False, sync: bool = False) -> dict:
        if (servers, sync) not in self._refs:
            name = f"ref{'_servers' if servers else ''}{'_sync' if sync else ''}"
            job = Job(self.work / name, self.steps, **self._variant(servers, sync))
            if job.finish() != 0:
                self.problems.append(f"reference run failed: {job.stderr()[-600:]}")
            self._refs[servers, sync] = chaos.Chaos.metrics(job.run)
        return self._refs[servers, sync]

    def problem(self, what: str, text: str) -> None:
        self.counts[what] += 1
        self.problems.append(text)

    def kill(self, run: Path, rank: int, servers: bool = False, async_save: bool = False):
        """kill -9 `rank` once or twice, each at a random point of a random step (async
        saves: inside a save)."""
        variant = self._variant(servers)
        if async_save:
            variant["extra"] = ASYNC_SAVE
        job = Job(run, self.steps, **variant)
        steps = sorted(self.rng.sample(range(1, self.steps), self.rng.randint(1, 2)))
        kind = f"{'servers_' if servers else 'async_' if async_save else ''}kill_rank{rank}"
        for step in steps:
            delay = self.rng.uniform(0.0, 0.3 if async_save else 1.5)
            if kill_rank(job, rank, step, delay, inside_save=async_save):
                self.counts[kind] += 1
        code = job.finish()
        self.counts["automatic_restarts"] += len(failures(run))
        if code != 0:
            self.problem("violations", f"{run.name}: exit {code}: {job.stderr()[-600:]}")
        self.compare(run, servers)
        left = job.leftovers()
        if left:
            self.problem("leftovers", f"{run.name}: processes {left} left")

    def sync_kill(self, run: Path, rank: int, servers: bool = False) -> None:
        """kill -9 `rank` inside the weight sync of one or two random versions (the first in
        restart round 0, the second in round 1)."""
        versions = sorted(self.rng.sample(range(1, self.steps), self.rng.randint(1, 2)))
        fault = ",".join(f"kill_rank{rank}_in_sync@{v}#{i}" for i, v in enumerate(versions))
        job = Job(run, self.steps, fault=fault, **self._variant(servers, sync=True))
        code = job.finish()
        done = failures(run)
        fired = sum(1 for i, v in enumerate(versions)
                    if any(f["round"] == i and f["step"] == v - 1 for f in done))
        self.counts[f"{'servers_' if servers else ''}sync_kill_rank{rank}"] += fired
        self.counts["automatic_restarts"] += len(done)
        if code != 0 or fired != len(versions):
            self.problem("violations", f"{run.name}: exit {code}, {fired} of {versions} fired, "
                         f"failures {done}: {job.stderr()[-600:]}")
        self.compare(run, servers, sync=True)
        left = job.leftovers()
        if left:
            self.problem("leftovers", f"{run.name}: processes {left} left")

    def compare(self, run: Path, servers: bool = False, sync: bool = False) -> None:
        ref, got = (_no_counters(rows) for rows in (self.reference(servers, sync),
                                                    chaos.Chaos.metrics(run)))
        if sorted(got) != list(range(self.steps)):
            self.problem("mismatches", f"{run.name}: metrics steps {sorted(got)}")
        for step in sorted(set(got) & set(ref)):
            if got[step] != ref[step]:
                diff = sorted(k for k in set(got[step]) | set(ref[step])
                              if got[step].get(k) != ref[step].get(k))
                self.problem("mismatches", f"{run.name}: step {step} differs in {diff[:6]}")
        c = chaos.Chaos(self.work, None, 0)
        c.check_complete(run)
        if c.problems:
            self.problem("violations", "; ".join(c.problems))
        if (run / "run.lock").exists() or (run / "checkpoints" / "checkpoints.lock").exists():
            self.problem("violations", f"{run.name}: a lock left after a clean exit")

    def repeat(self, run: Path) -> None:
        """Rank 1 dies at the same step in every round: stop after the third failure."""
        step = self.rng.randint(1, self.steps - 1)
        job = Job(run, self.steps, fault=f"kill_rank1_at_step@{step}")
        code = job.finish()
        self.counts["repeat"] += 1
        lines = [ln for ln in job.stderr().splitlines()
                 if ln.startswith("megatron-gspo: RepeatedFailure")]
        self.counts["automatic_restarts"] += len(failures(run))
        if code == 0 or not lines or f"step {step} failed 3 times" not in lines[0]:
            self.problem("violations", f"{run.name}: exit {code}, lines {lines[:1]}")
        if sorted(chaos.Chaos.metrics(run)) != list(range(step)):
            self.problem("mismatches", f"{run.name}: steps {sorted(chaos.Chaos.metrics(run))}")
        left = job.leftovers()
        if left:
            self.problem("leftovers", f"{run.name}: processes {left} left")

    def run_rounds(self, rounds: int, kinds: tuple[str, ...]) -> int:
        order = [kinds[i % len(kinds)] for i in range(rounds)]
        self.rng.shuffle(order)
        for variant in sorted({(k.startswith("servers_"), _in_sync(k)) for k in order
                               if k != "repeat"}):
            self.reference(*variant)
        for i, kind in enumerate(order):
            t0, before = time.time(), len(self.problems)
            run = self.work / f"r{i:02d}_{kind}"
            if kind == "repeat":
                self.repeat(run)
            elif _in_sync(kind):
                self.sync_kill(run, int(kind[-1]), kind.startswith("servers_"))
            else:
                self.kill(run, int(kind[-1]), kind.startswith("servers_"),
                          kind.startswith("async_"))
            status = "ok" if len(self.problems) == before else "; ".join(self.problems[before:])
            print(f"round {i} {kind}: {time.time() - t0:.0f}s {status}", flush=True)
        keys = ("automatic_restarts", "mismatches", "leftovers", "violations")
        inj = {k: v for k, v in sorted(self.counts.items()) if k not in keys}
        print("injections: " + json.dumps(inj))
        print("  ".join(f"{k}: {self.counts[k]}" for k in keys) + f"  problems: "
              f"{len(self.problems)}")
        return 1 if self.problems else 0


def parse_args(argv: list[str] | None, doc: str, known: tuple[str, ...], prefix: str,
               steps: bool = False, refuse=lambda: None) -> tuple:
    """A chaos script's command line: `--rounds --seed --workdir --kinds` (and `--steps`);
    returns (args, the chosen kinds, the work directory). `refuse()` returns a reason not to
    run (an error of the command line) or None."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=len(known))
    ap.add_argument("--seed", type=int, default=0)
    if steps:
        ap.add_argument("--steps", type=int, default=chaos.STEPS)
    ap.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    ap.add_argument("--kinds", default=",".join(known), help="comma-separated kinds")
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if set(kinds) - set(known):
        ap.error(f"unknown kinds {sorted(set(kinds) - set(known))}; known: {', '.join(known)}")
    reason = refuse()
    if reason:
        ap.error(reason)
    return args, kinds, Path(args.workdir or tempfile.mkdtemp(prefix=prefix))


def main(argv: list[str] | None = None) -> int:
    args, kinds, work = parse_args(argv, __doc__, KINDS, "chaos_torchrun_", steps=True)
    return TorchrunChaos(work, args.seed, args.steps).run_rounds(args.rounds, kinds)


if __name__ == "__main__":
    sys.exit(main())
