"""The weight-update group's address in disaggregated mode: MASTER_ADDR is 127.0.0.1 on a
single learner node (docker/launch/torchrun.sh), which servers on other hosts cannot reach."""

from __future__ import annotations

import pytest

from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.rollout.multinode import node_servers as multinode
from megatron_gspo.rollout.engine import SamplingParams


def test_local_servers_keep_master_addr():
    env = {"MASTER_ADDR": "127.0.0.1"}
    assert multinode.update_master_address(["http://127.0.0.1:30000"], env) == "127.0.0.1"
    assert multinode.update_master_address(["http://10.0.0.9:30000"], {"MASTER_ADDR": "node-0"}
                                           ) == "node-0"
    assert multinode.update_master_address([], {}) == "127.0.0.1"


def test_remote_servers_get_a_routable_address(monkeypatch):
    seen = []
    monkeypatch.setattr(multinode, "_route_address", lambda h: seen.append(h) or "10.0.0.5")
    urls = ["http://127.0.0.1:1", "http://10.0.0.9:30000", "http://[fd00::2]:30001"]
    assert multinode.update_master_address(urls, {"MASTER_ADDR": "127.0.0.1"}) == "10.0.0.5"
    assert seen == ["10.0.0.9"]
    monkeypatch.setattr(multinode, "_route_address", lambda h: None)
    with pytest.raises(ValueError, match="rollout.weight_sync_master") as e:
        multinode.update_master_address(urls, {"MASTER_ADDR": "127.0.0.1"})
    assert len(str(e.value).splitlines()) == 1


def test_route_address_of_this_host():
    assert multinode._route_address("127.0.0.1") == "127.0.0.1"


def test_built_engine_uses_the_routable_address(monkeypatch, tmp_path):
    from megatron_gspo.loop.server_setup import sglang_engine

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr(multinode, "_route_address", lambda h: "10.0.0.5")
    cfg = load_config(None, [f"model.path={tmp_path}", "rollout.engine=sglang",
                             "rollout.server_urls=[http://10.0.0.9:30000]",
                             "rollout.weight_sync=distributed"])
    eng = sglang_engine(cfg, SamplingParams())
    try:
        assert eng.dist_master[0] == "10.0.0.5"
    finally:
        eng.shutdown()
    monkeypatch.setattr(multinode, "_route_address", lambda h: None)
    with pytest.raises(ConfigError, match="MASTER_ADDR is 127.0.0.1, which they cannot reach"):
        sglang_engine(cfg, SamplingParams())


def test_rollout_host_internal_is_the_nodes_cluster_address(monkeypatch):
    """`rollout.host: internal` (the shipped 2-node config): what the host name resolves to;
    when that is loopback, the address on the route to MASTER_ADDR; never loopback."""
    assert multinode.bind_host("10.1.2.3") == "10.1.2.3"
    assert multinode.bind_host("127.0.0.1") == "127.0.0.1"  # other values as given
    monkeypatch.setattr(multinode.socket, "gethostbyname", lambda name: "10.0.0.7")
    assert multinode.bind_host("internal", {}) == "10.0.0.7"
    monkeypatch.setattr(multinode.socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(multinode, "_route_address", lambda h: "10.0.0.8" if h == "node-0"
                        else None)
    assert multinode.bind_host("internal", {"MASTER_ADDR": "node-0"}) == "10.0.0.8"
    with pytest.raises(ValueError, match="rollout.host=internal") as e:
        multinode.bind_host("internal", {"MASTER_ADDR": "127.0.0.1"})
    assert len(str(e.value).splitlines()) == 1
