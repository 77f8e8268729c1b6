"""A multi-node restart (issue 45): two torchrun agents as two "nodes" on 127.0.0.1 (static
rendezvous, `--nnodes 2 --node-rank 0|1`, one rank each: the tiny demo with TP2 across the
nodes). Node 1's rank is killed with -9 at step 2 of the first round; node 0's rank then loses
its peer, both agents restart their groups, and the job continues from the newest complete
checkpoint by itself: both agents exit 0, the metrics equal a single-node torchrun run's, no
process of either node is left."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_rank_killed_on_node_1_restarts_both_nodes_and_the_run_matches(tmp_path):
    import chaos
    import chaos_torchrun as ct

    steps = 4
    c = ct.TorchrunChaos(tmp_path, seed=0, steps=steps)
    ref = c.reference()
    run, port = tmp_path / "two_nodes", _free_port()
    settings = [s for s in chaos.SETTINGS if not s.startswith("train.max_steps=")]
    agents, seen = [], set()
    for node in (0, 1):
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        env.pop("MEGATRON_GSPO_FAULT", None)
        if node == 1:
            env["MEGATRON_GSPO_FAULT"] = "kill_rank1_at_step@2#0"  # round 0 only
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               f"--node-rank={node}", "--nproc-per-node=1", "--max-restarts=3",
               "--monitor-interval=1", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "megatron_gspo.cli", "train", str(chaos.CONFIG), "--run-dir", str(run),
               f"train.max_steps={steps}", "parallel.tensor=2", "train.deterministic=true",
               *settings]
        err = open(tmp_path / f"node{node}.stderr", "w")
        agents.append(subprocess.Popen(cmd, cwd=ct.ROOT, env=env, stdout=subprocess.DEVNULL,
                                       stderr=err, start_new_session=True))
    import psutil

    deadline = time.time() + ct.RUN_TIMEOUT
    while any(a.poll() is None for a in agents) and time.time() < deadline:
        for a in agents:  # every process either node ever had (for the leftover check)
            try:
                seen.update(k.pid for k in psutil.Process(a.pid).children(recursive=True))
            except psutil.Error:
                pass
        time.sleep(0.2)
    for a in agents:
        if a.poll() is None:
            os.killpg(a.pid, 9)
            a.wait()
    logs = [(tmp_path / f"node{n}.stderr").read_text(errors="replace")[-2000:] for n in (0, 1)]
    assert [a.returncode for a in agents] == [0, 0], logs
    (fail,) = ct.failures(run)  # one automatic restart: node 1's rank at step 2
    assert (fail["round"], fail["step"]) == (0, 2), fail
    c.compare(run)  # every row equals the single-node run's; COMPLETE checkpoints verify
    assert c.problems == [], c.problems
    assert chaos.Chaos.metrics(run) == ref
    grace = time.time() + 30
    left = sorted(seen)
    while left and time.time() < grace:
        left = [p for p in left if chaos._alive(p)]  # noqa: SLF001
        time.sleep(0.2)
    for p in left:
        os.kill(p, 9)
    assert left == []
