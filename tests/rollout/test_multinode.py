"""Colocated generation on every node: two torchrun launches on localhost (--nnodes=2, 2 ranks
each, parallel.tensor=2), each node leader launching two stand-in SGLang servers. Every node's
servers generate, every server's weights equal the learner's after each sync, and a server of
node 1 that dies mid-rollout loses no sample (retried elsewhere, restarted by node 1 at the next
sync). A node whose servers cannot start stops the job with one line naming it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_multinode_worker.py")
STANDIN = "megatron_gspo.rollout.standin.server"
STEPS, SAMPLES = 3, 16  # train.max_steps, prompts_per_step x group_size in the worker


def _two_nodes(tmp: Path, env_of=lambda node: {}, extra=()):
    """Run both node launches at once; returns ({rank: result}, [(rc, stderr)] per node)."""
    from megatron_gspo.megatron.parallel import free_port
    from megatron_gspo.rollout.sglang.launch import pick_ports

    model, out = ROOT / "examples" / "tiny" / "base", tmp / "out"  # rewards vary: weights move
    out.mkdir(exist_ok=True)
    port, base = free_port(), pick_ports("127.0.0.1", 20000, 1)[0]
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
               "SGLANG_SERVER_MODULE": STANDIN, **env_of(node)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               f"--node-rank={node}", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={port}", str(WORKER), str(model), str(tmp / "run"), str(out),
               str(base), *extra]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    ends = []
    for p in procs:
        _, err = p.communicate(timeout=900)
        ends.append((p.returncode, err))
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    return results, ends


@pytest.mark.slow
def test_two_nodes_generate_sync_and_survive_a_dead_server(tmp_path):
    res, ends = _two_nodes(tmp_path, lambda node: {"CRASH_FIRST_SERVER": "1"})
    assert [r["error"] for r in res.values() if r["error"]] == []
    for rc, err in ends:
        assert rc == 0, err[-4000:]
    assert sorted(res) == [0, 1, 2, 3]
    assert res[0]["node_of"] == [0, 0, 1, 1]
    assert [res[r]["type"] for r in range(4)] == ["MultiNodeEngine", "NoneType",
                                                   "NodeServers", "NoneType"]
    assert res[0]["node"] == 0 and res[2]["node"] == 1
    urls = {0: res[0]["urls"], 1: res[2]["urls"]}
    assert len(urls[0]) == len(urls[1]) == 2 and not set(urls[0]) & set(urls[1])
    # Rank 0's client knows every node's servers after every sync.
    for seen in res[0]["client_urls"]:
        assert sorted(seen) == sorted(urls[0] + urls[1])

    # Every server's weights equal the learner's after each sync (initial = v0, then 1..3).
    recs = res[0]["records"] + res[2]["records"]
    for v in range(STEPS + 1):
        at = [r for r in recs if r["version"] == v]
        assert len(at) == 4, at
        for r in at:
            assert r["digest"] == r["learner"], (v, r["url"])
            assert r["weight_version"] == str(v)
    assert len({r["learner"] for r in recs}) == STEPS + 1  # the weights did change each step

    # Every node's servers produced samples in every rollout; every server got requests.
    assert len(res[0]["sample_servers"]) == STEPS
    for servers in res[0]["sample_servers"]:
        assert len(servers) == SAMPLES
        for node in (0, 1):
            assert any(u in urls[node] for u in servers), (node, servers)
    assert all(r["stats"]["generate_calls"] > 0 for r in recs if r["version"] == STEPS)
    dead = urls[1][0]  # crashed on its first request: no sample from it in the first rollout,
    first, *later = res[0]["sample_servers"]  # then back in rotation once restarted
    assert dead not in first and any(dead in servers for servers in later)

    # Node 1's server 0 died on its first request; nothing was lost, it was restarted.
    run = tmp_path / "run"
    events = (run / "events.log").read_text()
    assert "node 1: restarted server 0" in events and "exited with code 1" in events
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    for row in rows:
        assert row["rollout/samples"] == SAMPLES
        assert row["rollout/engine_failed_total"] == 0
        assert row["weight_sync/nodes"] == 2 and row["weight_sync/servers"] == 4
    assert rows[0]["rollout/engine_retries_total"] >= 1
    assert rows[0]["weight_sync/restarted_servers"] == 1
    assert sum(r["weight_sync/restarted_servers"] for r in rows) == 1


@pytest.mark.slow
def test_a_node_whose_servers_cannot_start_stops_the_job(tmp_path):
    # Node 1's servers refuse their gRPC port at start, as SGLang does (port + 10000 > 65535).
    res, ends = _two_nodes(tmp_path, lambda node: {"SGLANG_GRPC_PORT": "70000"} if node else {})
    assert all(rc != 0 for rc, _ in ends)
    errors = {r["error"] for r in res.values()}
    assert len(res) == 4 and len(errors) == 1, errors
    (error,) = errors
    assert "node 1 (" in error and "its rollout servers did not start" in error
    assert "exited with code 1 before becoming healthy" in error and "\n" not in error
