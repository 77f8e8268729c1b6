"""The sync probe is on by default (issue 54, defect 16): a weight sync that the servers accept
but that changes nothing is caught without the user knowing `rollout.verify_sync_interval`.
Its cost was measured with bench/sync_probe_cost.py (docs/weight-sync.md)."""

from __future__ import annotations

import pytest

from megatron_gspo.config import Config, load_config
from megatron_gspo.rollout.engine import RolloutError
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.standin.server import StandinServer


def test_probe_is_on_by_default():
    sglang = ["rollout.engine=sglang", "model.path=/m"]
    assert Config().rollout.verify_sync_interval == 1
    assert load_config(None, sglang).rollout.verify_sync_interval == 1
    off = load_config(None, [*sglang, "rollout.verify_sync_interval=0"])
    assert off.rollout.verify_sync_interval == 0  # still possible, by name


def test_a_sync_that_changed_nothing_fails_under_the_default_config(engine, tiny_model_dir,
                                                                     monkeypatch):
    """`loop.weight_sync_phase.sync_weights` with the default settings: the learner's (shifted)
    weights go
    out under names the server does not know, which SGLang answers 200 "Success" and ignores;
    the probe after the sync names it."""
    from megatron_gspo.loop import weight_sync_phase as sync_mod
    from megatron_gspo.megatron.io import weight_export as export
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from tests.rollout._sglang_real import RecomputeLearner

    learner_side = EmbeddedEngine(tiny_model_dir)
    shifted = [(k, v.detach() + 0.1) for k, v in learner_side.model.named_parameters()]
    learner_side.load_buckets([shifted], 1)
    unknown = [(f"unknown_{i}", v) for i, (_, v) in enumerate(shifted)]
    monkeypatch.setattr(export, "export_hf_weights", lambda *a, **k: iter([unknown]))

    class Learner(RecomputeLearner):
        chunks: list = []

    srv = StandinServer(engine, model_path=tiny_model_dir).start_in_thread()
    eng = SGLangEngine(server_urls=[srv.url], backoff_s=0.01, weight_sync="tensor")
    cfg = load_config(None, ["model.dtype=float32", "rollout.engine=sglang",
                             f"rollout.server_urls=[{srv.url}]", "rollout.colocate=false",
                             "rollout.weight_sync=distributed"])  # the engine's own path
    try:
        with pytest.raises(RolloutError, match="weight sync to version 1 not verified"):
            sync_mod.sync_weights(Learner(learner_side.model), eng, {}, cfg, version=1)
        assert srv.stats["weight_updates"] == 1  # the sync reached the server, and did nothing
    finally:
        eng.shutdown()
        srv.stop_thread()


def test_probe_over_every_node_leaves_out_a_server_that_is_gone(engine, tiny_model_dir):
    """Rank 0's client over every node's servers (`multinode.ClusterClient`): a server whose
    connection is refused is left out of the probe and of the rotation (`down`: its node
    restarts it, and it is probed, at the next sync), as generation does; the run is not ended
    by the probe it made the default. With none answering the probe fails."""
    import socket

    from megatron_gspo.rollout.multinode.node_servers import ClusterClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}"
    srv = StandinServer(engine, model_path=tiny_model_dir).start_in_thread()
    client = ClusterClient([srv.url], backoff_s=0.01)
    try:
        client.sync(client.astart())
        client.urls.append(gone)
        probes = client.sync(client.aprobe_servers(1.0))
        assert [u for u, _, _ in probes] == [srv.url] and client.down == {gone}
        client.urls = [gone]
        with pytest.raises(RolloutError, match="no server answered the sync probe"):
            client.sync(client.aprobe_servers(1.0))
    finally:
        client.shutdown()
        srv.stop_thread()
