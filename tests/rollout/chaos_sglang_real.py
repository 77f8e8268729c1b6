"""Chaos under a real `torchrun --nproc_per_node 2 --max-restarts 3` with SGLang's real CPU
server (issue 45; the `sglang_real` tier's install): the tiny demo (TP2, a checkpoint every
step) on one colocated server launched by rank 0, kill -9 of rank 1 or rank 0, and no person
acts. Kinds: `kill_rank1/0` once or twice, each at a random point after the first or second
checkpoint the current round completed (in the rollout, the training or the next save; a second
kill waits for the restarted round to begin), `sync_kill_rank1/0` inside a weight sync (the
fault `kill_rank<R>_in_sync@V#N` of runtime/faults.py: once the first 1 MiB bucket reached the
server, which then holds a mix of two weight versions). Checked per job: exit code
0; one automatic restart per injection and the resume in events.log; a metrics row for every
step, each after the last resume with its sync verified by the probe
(`rollout.verify_sync_interval=1`); every COMPLETE checkpoint verifies; no lock; every round
ran its own server (a new pid) and no process of the job is left: torchrun, the ranks of every
round (tests/loop/chaos_torchrun.py's `Job`), every process carrying the job's TIER_RUN_TAG and
every process in a server's session (the real servers' scheduler and detokenizer processes,
whose retitled /proc/PID/environ no longer shows the tag). Rows are not compared with an
uninterrupted run: see tests/rollout/test_sglang_real_restart.py.

    MEGATRON_GSPO_SGLANG_CPU=$PWD/.sglang-cpu .venv/bin/python tests/rollout/chaos_sglang_real.py \\
        --rounds 10 --seed 0 [--kinds sync_kill_rank1,sync_kill_rank0] [--workdir DIR]

Prints one line per round and the counts per kind; exit code 1 on any problem.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "loop"))

import chaos  # noqa: E402
import chaos_torchrun as ct  # noqa: E402

from tests.rollout import _sglang_real as tier  # noqa: E402

KINDS = ("kill_rank1", "kill_rank0", "sync_kill_rank1", "sync_kill_rank0")
STEPS = 4
RUN_TIMEOUT = 1200.0  # seconds a whole job may take on 2 loaded cores (a hang is a failure)
GRACE = 60.0  # seconds the job's processes get to end after torchrun exited


def tagged(tag: str) -> list[tuple[int, str]]:
    from tests.rollout.test_sglang_real_training import _tagged

    return _tagged(tag)


def servers(tag: str) -> dict[int, int]:
    """pid -> torchrun restart round of each live real server of the job: a launch_server
    process whose parent is a rank (TORCHELASTIC_RESTART_COUNT in the parent's environment;
    the launcher strips it from the server's own)."""
    out = {}
    for pid, cmd in tagged(tag):
        if "sglang.launch_server" not in cmd:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{ppid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for item in env:
            if item.startswith(b"TORCHELASTIC_RESTART_COUNT="):
                out[pid] = int(item.split(b"=", 1)[1])
    return out


class ServerWatch(threading.Thread):
    """Notes every real server of the job (pid -> round) while it runs."""

    def __init__(self, tag: str) -> None:
        super().__init__(daemon=True)
        self.tag, self.seen = tag, {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.seen.update(servers(self.tag))
            self.done.wait(0.3)

    def stop(self) -> dict[int, int]:
        self.done.set()
        self.join()
        return self.seen


def start(run: Path, port: int, fault: str = "") -> tuple[ct.Job, str, ServerWatch]:
    """The torchrun job on a launched real server (base port `port`), tagged for the sweep."""
    tag = uuid.uuid4().hex
    extra = ("train.deterministic=false", *tier.train_args(), "rollout.colocate=true",
             "rollout.num_servers=1", f"rollout.base_port={port}", *ct.SYNC)
    job = ct.Job(run, STEPS, max_restarts=3, fault=fault, extra=extra,
                 env_extra={"TIER_RUN_TAG": tag})
    watch = ServerWatch(tag)
    watch.start()
    return job, tag, watch


def free_base_port(rng: random.Random) -> int:
    from megatron_gspo.rollout.sglang.launch import pick_ports

    return pick_ports("127.0.0.1", 21000 + rng.randrange(0, 400) * 20, 1)[0]


def in_sessions(sids: set[int]) -> list[tuple[int, str]]:
    """(pid, command line) of live processes in the sessions `sids` (a launched server runs in
    a session of its own: its scheduler and detokenizer stay in it, also once reparented, and
    their retitled processes (setproctitle) no longer show the tag in /proc/PID/environ)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] == "Z" or int(fields[3]) not in sids:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append((int(pid), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, ValueError, IndexError):
            continue
    return out


def leftovers(job: ct.Job, tag: str, server_pids=()) -> list[str]:
    """Processes of the job alive `GRACE` seconds after torchrun ended (killed here): the ones
    seen under torchrun, every one carrying the job's tag and every one in a server's session."""
    left = [f"{pid} (under torchrun)" for pid in job.leftovers(GRACE)]
    deadline = time.time() + GRACE

    def alive():
        return dict(tagged(tag) + in_sessions(set(server_pids)))

    while alive() and time.time() < deadline:
        time.sleep(0.2)
    for pid, cmd in alive().items():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        left.append(f"{pid} ({cmd[:120]})")
    return left


def kill_in_round(job: ct.Job, rank: int, rnd: int, saves: int, delay: float) -> bool:
    """kill -9 of `rank` `delay` seconds after restart round `rnd` (begun: its run-dir line is
    in events.log) completed its `saves`-th checkpoint; False when the job ended before."""
    deadline, begun = time.time() + RUN_TIMEOUT, None
    log = job.run / "events.log"
    while job.p.poll() is None and time.time() < deadline:
        job.ranks()
        if begun is None:
            text = log.read_text(errors="replace") if log.exists() else ""
            if len(re.findall(r"; (?:resumed from|starting from the initial weights)",
                              text)) > rnd:
                begun = time.time()
        else:
            new = 0
            for p in (job.run / "checkpoints").glob("step_*/COMPLETE"):
                try:
                    new += p.stat().st_mtime >= begun
                except OSError:  # removed by checkpoint.keep_last
                    pass
            if new >= saves:
                return ct.kill_rank(job, rank, None, delay)
        time.sleep(0.05)
    return False


def check(job: ct.Job, tag: str, watch: ServerWatch, code: int, restarts: int) -> list[str]:
    """What went wrong with a job that should have restarted `restarts` times by itself."""
    run, problems = job.run, []
    seen = watch.stop()
    done = ct.failures(run)
    if code != 0:
        problems.append(f"exit {code}: {job.stderr()[-800:]}")
    if len(done) != restarts:
        problems.append(f"{len(done)} automatic restarts recorded, {restarts} expected: {done}")
    events = (run / "events.log").read_text() if (run / "events.log").exists() else ""
    starts = re.findall(r"; (?:resumed from \S+ at step (\d+)|starting from the initial weights)",
                        events)  # one per round: the resume step ("" when starting over)
    if len(re.findall(r"automatic restart \d of 3 \(torchrun\)", events)) != restarts or \
            len(starts) != restarts + 1:
        problems.append(f"events.log: {restarts} restarts and resumes expected: "
                        f"{events[-1500:]}")
    rows = chaos.Chaos.metrics(run)
    if sorted(rows) != list(range(STEPS)):
        problems.append(f"metrics steps {sorted(rows)}")
    first = int(starts[-1] or 0) if starts else 0  # the last round's first step
    after = [s for s in rows if s >= first]
    unverified = [s for s in after if not rows[s].get("weight_sync/probe_max_diff", 1.0) < 1e-3]
    if first < STEPS and (not after or unverified):
        problems.append(f"syncs after the last resume not verified by the probe: steps "
                        f"{unverified or after}")
    c = chaos.Chaos(run.parent, None, 0)
    c.check_complete(run)
    problems += c.problems
    if (run / "run.lock").exists() or (run / "checkpoints" / "checkpoints.lock").exists():
        problems.append("a lock left after a clean exit")
    rounds = sorted(set(seen.values()))
    if rounds != list(range(restarts + 1)):
        problems.append(f"real servers seen in rounds {rounds}, expected one per round "
                        f"0..{restarts}: {seen}")
    left = leftovers(job, tag, seen)
    if left:
        problems.append(f"processes left: {left}")
    return problems


class RealChaos:
    """The injections and their counts, per kind."""

    def __init__(self, work: Path, seed: int) -> None:
        self.work, self.rng = work, random.Random(seed)
        self.counts: dict[str, Counter] = {}
        self.problems: list[str] = []

    def round(self, i: int, kind: str) -> str:
        run = self.work / f"r{i:02d}_{kind}"
        rank = int(kind[-1])
        steps = sorted(self.rng.sample(range(1, STEPS), self.rng.randint(1, 2)))
        fault = ",".join(f"kill_rank{rank}_in_sync@{v}#{n}" for n, v in enumerate(steps)) \
            if kind.startswith("sync_") else ""
        job, tag, watch = start(run, free_base_port(self.rng), fault)
        fired = 0
        if not fault:
            for _ in steps:  # each kill in the round the kill before started
                fired += kill_in_round(job, rank, fired, self.rng.randint(1, 2),
                                       self.rng.uniform(0.0, 1.5))
        code = job.finish(RUN_TIMEOUT)
        if fault:  # a targeted kill fired when its round failed at step V - 1
            done = ct.failures(run)
            fired = sum(1 for n, v in enumerate(steps)
                        if any(f["round"] == n and f["step"] == v - 1 for f in done))
        problems = check(job, tag, watch, code, fired)
        if fault and fired != len(steps):
            problems.append(f"{fired} of the faults {fault} fired")
        counts = self.counts.setdefault(kind, Counter())
        counts.update(rounds=1, injections=fired, automatic_restarts=len(ct.failures(run)),
                      leftovers=sum("processes left" in p for p in problems),
                      violations=sum("processes left" not in p for p in problems))
        self.problems += [f"{run.name}: {p}" for p in problems]
        return "; ".join(problems) or "ok"

    def run_rounds(self, rounds: int, kinds: tuple[str, ...]) -> int:
        order = [kinds[i % len(kinds)] for i in range(rounds)]
        self.rng.shuffle(order)
        t_all = time.time()
        for i, kind in enumerate(order):
            t0 = time.time()
            status = self.round(i, kind)
            self.counts[kind]["wall_s"] += round(time.time() - t0)
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"round {i} {kind}: {time.time() - t0:.0f} s, load {load}: {status}",
                  flush=True)
        print(f"SGLang {tier.version()}, {rounds} rounds in {time.time() - t_all:.0f} s")
        for kind, counts in sorted(self.counts.items()):
            print(f"{kind}: " + json.dumps(dict(counts)))
        print(f"problems: {len(self.problems)}")
        return 1 if self.problems else 0


def _not_installed() -> str | None:
    if (tier.install_dir() / ".installed").is_file():
        return None
    return (f"SGLang CPU server not installed in {tier.install_dir()} "
            "(scripts/sglang_cpu.sh; MEGATRON_GSPO_SGLANG_CPU names another install)")


def main(argv: list[str] | None = None) -> int:
    args, kinds, work = ct.parse_args(argv, __doc__, KINDS, "chaos_sglang_real_",
                                      refuse=_not_installed)
    return RealChaos(work, args.seed).run_rounds(args.rounds, kinds)


if __name__ == "__main__":
    sys.exit(main())
