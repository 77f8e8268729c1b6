"""Pieces of colocated generation on every node, in one process: the node layout, per-node
launch settings, the per-node entry plan of the weight sync, advertised URLs, and rank 0's
client leaving a server that refuses connections out of the rotation without losing a sample
(the 2-node torchrun run is tests/rollout/test_multinode.py)."""

from __future__ import annotations

import socket

import pytest

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from megatron_gspo.rollout.multinode.node_servers import (
    ClusterClient,
    advertised,
    layout_from,
    node_spec,
    nodes_in_job,
)
from megatron_gspo.rollout.multinode.weight_sync_nodes import node_plan
from megatron_gspo.rollout.sglang.launch import LaunchSpec


def test_layout_groups_ranks_by_node_key():
    infos = [("group 0", 0, "a"), ("group 0", 1, "a"), ("group 1", 0, "a"), ("group 1", 1, "a")]
    lay = layout_from(infos, rank=2)
    assert lay.node_of == (0, 0, 1, 1) and lay.nodes == 2 and lay.node == 1
    assert lay.ranks_of(1) == [2, 3] and lay.leader(1) == 2 and lay.is_leader
    assert not layout_from(infos, rank=3).is_leader
    # Node order follows the lowest rank on each node, whatever the keys are.
    lay = layout_from([("host b", None, "b"), ("host a", None, "a"), ("host b", None, "b")])
    assert lay.node_of == (0, 1, 0) and lay.leader(1) == 1


def test_nodes_in_job_from_torchrun_environment():
    assert nodes_in_job({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == 2
    assert nodes_in_job({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}) == 1
    assert nodes_in_job({}) == 1


def test_node_spec_shifts_ports_seeds_and_logs():
    spec = LaunchSpec(model_path="m", num_servers=4, base_port=30000, seed=7, log_dir="/l")
    one = node_spec(spec, 1)
    assert (one.base_port, one.seed, one.log_dir) == (30004, 11, "/l/node1")
    assert node_spec(spec, 0).base_port == 30000
    assert node_spec(LaunchSpec(model_path="m", base_port=0), 3).base_port == 0  # any free


def test_node_plan_uses_the_learner_ranks_of_the_same_node():
    infos = [("g0", d, "a") for d in range(4)] + [("g1", d, "b") for d in range(4)]
    lay = layout_from(infos)
    assert node_plan(lay, 0, num_servers=2, tp_size=2) == [[0, 1], [2, 3]]
    assert node_plan(lay, 1, num_servers=2, tp_size=2) == [[4, 5], [6, 7]]
    assert node_plan(lay, 1, num_servers=1, tp_size=2, base_gpu_id=2) == [[6, 7]]
    short = layout_from(infos[:7])  # node 1 has no learner rank on its GPU 3
    with pytest.raises(RolloutError, match="node 1's server 1 TP rank 1 runs on GPU 3"):
        node_plan(short, 1, num_servers=2, tp_size=2)
    assert node_plan(layout_from([("g0", None, "a")]), 0, 1, 1) is None  # no CUDA


def test_advertised_names_every_interface_by_the_node_address():
    me = socket.gethostbyname(socket.gethostname())
    assert advertised(["http://0.0.0.0:30000", "http://10.0.0.2:30001"]) == [
        f"http://{me}:30000", "http://10.0.0.2:30001"]


def test_client_leaves_a_refusing_server_out_and_loses_no_sample(engine):
    from megatron_gspo.rollout.standin.server import StandinServer

    servers = [StandinServer(engine, model_path="tiny").start_in_thread() for _ in range(2)]
    with socket.socket() as s:  # a port where nothing listens: a dead server
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = ClusterClient([dead, *(s.url for s in servers)], backoff_s=0.01,
                           request_timeout_s=30, max_retries=2)
    try:
        client._started = True  # the dead URL would fail the /server_info check at start
        sp = SamplingParams(max_new_tokens=3, n=4)
        out = client.generate([GenerateRequest(prompt_ids=[5, 6, 7], sampling=sp)] * 3)
        assert len(out) == 12 and all("rollout_error" not in s.metadata for s in out)
        assert {s.metadata["server"] for s in out} <= {s.url for s in servers}
        assert client.down == {dead} and client.metrics["failed"] == 0
        assert 1 <= client.metrics["retries"] < 12  # once down, the dead server gets no more
        client.set_urls([s.url for s in servers], version=3)
        assert client.down == set() and client.weight_version == 3
    finally:
        client.shutdown()
        for s in servers:
            s.stop_thread()


def test_sync_probe_covers_every_nodes_servers(engine, tiny_model_dir):
    """`rollout.verify_sync_interval` on a multi-node colocated job: rank 0's engine probes
    every node's servers and the learner's recompute checks them."""
    from megatron_gspo.config import load_config
    from megatron_gspo.loop.weight_sync_phase import verify_sync
    from megatron_gspo.rollout.multinode.node_servers import MultiNodeEngine
    from megatron_gspo.rollout.standin.server import StandinServer
    from tests.rollout._sglang_real import RecomputeLearner

    class Local:  # node 0's servers (only shut down here)
        def shutdown(self):
            pass

    servers = [StandinServer(engine, model_path=tiny_model_dir).start_in_thread()
               for _ in range(2)]
    client = ClusterClient([s.url for s in servers], backoff_s=0.01)
    client._started = True
    eng = MultiNodeEngine(Local(), client)
    cfg = load_config(None, ["model.dtype=float32", "rollout.temperature=0.8"])
    try:
        assert verify_sync(RecomputeLearner(engine.model), eng, cfg, 0) < 1e-4
        assert all(s.stats["generate_calls"] == 1 for s in servers)
    finally:
        eng.shutdown()
        for s in servers:
            s.stop_thread()
