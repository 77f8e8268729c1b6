"""Delta weight sync against the stand-in server (`rollout.weight_sync_delta`): the served
weights equal the learner's bit for bit after every sync, the bytes sent shrink, and the next
sync is full after a server restart, a release of the weights region, or on a base the server
does not hold (which the loader refuses, ending the server as SGLang's scheduler would)."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.rollout.delta.sender import DeltaSender
from megatron_gspo.rollout.sglang import weight_sync_delta as delta_sync
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.standin.server import StandinServer


@pytest.fixture()
def loader_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(delta_sync.loader_dir(str(tmp_path / "loader")))


def _server(engine, port=0, loaders=(delta_sync.LOADER,)):
    return StandinServer(engine, port=port, model_path="tiny",
                         custom_weight_loaders=loaders).start_in_thread()


def _learner(engine, dtype=torch.float32):
    return {k: v.detach().to(dtype).clone() for k, v in engine.model.named_parameters()}


def _step(w, share, seed, scale=1e-2):
    """A sparse update of `w`: `share` of each tensor's elements move by `scale` relative."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in w.items():
        m = torch.rand(v.shape, generator=g) < share
        nv = v.clone()
        nv[m] = (v.float()[m] * (1 + scale * torch.randn(int(m.sum()), generator=g))).to(v.dtype)
        out[k] = nv
    return out


def _served_equals(engine, w) -> bool:
    params = dict(engine.model.named_parameters())
    return all(torch.equal(params[k].detach().view(torch.uint8), w[k].view(torch.uint8))
               for k in w)


def _sync(client, w, version, bucket=4):
    names = sorted(w)
    client.update_weights([[(n, w[n]) for n in names[i:i + bucket]]
                           for i in range(0, len(names), bucket)], version)
    return client.delta.stats


def test_tensor_path_deltas_are_exact_and_small(engine, loader_path):
    srv = _server(engine)
    client = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    client.delta = DeltaSender("on")
    try:
        w = _learner(engine)
        st = _sync(client, w, 1)
        assert (st.delta, st.reason) == (False, "first sync") and _served_equals(engine, w)
        for v in (2, 3):
            w = _step(w, 0.01, seed=v)
            st = _sync(client, w, v)
            assert st.delta and _served_equals(engine, w), v
            assert st.bytes_sent < st.bytes_full / 10 and 0.005 < st.share() < 0.02
            assert st.kinds["sparse"] > 0 and st.apply_s > 0 and st.encode_s > 0
        st = _sync(client, w, 4)  # nothing changed: manifests only
        assert st.delta and st.changed == 0 and st.kinds["same"] == len(w)
        assert srv.weight_version == "4" and srv.stats["weight_updates"] >= 4
    finally:
        client.shutdown()
        srv.stop_thread()


def test_restart_and_release_force_a_full_sync(engine, tiny_model_dir, loader_path):
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    srv = _server(engine)
    client = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    client.delta = DeltaSender("on")
    try:
        w = _learner(engine)
        _sync(client, w, 1)
        w = _step(w, 0.02, seed=1)
        assert _sync(client, w, 2).delta
        port = srv.port
        srv.stop_thread()  # a restart: a new process on the same address holds no base
        fresh = EmbeddedEngine(tiny_model_dir, seed=5)
        srv = _server(fresh, port=port)
        w = _step(w, 0.02, seed=2)
        st = _sync(client, w, 3)
        assert not st.delta and "serves weight version 'default'" in st.reason
        assert _served_equals(fresh, w)
        w = _step(w, 0.02, seed=3)
        assert _sync(client, w, 4).delta and _served_equals(fresh, w)
        client.release_memory(["weights"])  # no CPU backup: the served weights are gone
        client.resume_memory(["weights"])
        w = _step(w, 0.02, seed=4)
        st = _sync(client, w, 5)
        assert not st.delta and "released" in st.reason and _served_equals(fresh, w)
    finally:
        client.shutdown()
        srv.stop_thread()


def test_a_delta_on_a_base_the_server_lacks_ends_it(engine, tiny_model_dir, loader_path,
                                                     monkeypatch):
    from megatron_gspo.rollout.engine import RolloutError
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    srv = _server(engine)
    client = SGLangEngine(server_urls=[srv.url], backoff_s=0.01, max_retries=0)
    client.delta = DeltaSender("on")
    try:
        w = _learner(engine)
        _sync(client, w, 1)
        port = srv.port
        srv.stop_thread()
        srv = _server(EmbeddedEngine(tiny_model_dir, seed=5), port=port)

        async def unchecked(engine, sender):  # the learner's check skipped: the loader's holds
            return None

        monkeypatch.setattr(delta_sync, "acheck_base", unchecked)
        with pytest.raises(RolloutError):
            _sync(client, _step(w, 0.02, seed=1), 2)
        assert "full sync is needed" in (srv.died or "")
        assert client.delta.acked_version is None  # a failed sync forgets the base
    finally:
        client.shutdown()
        srv.stop_thread()


def test_disk_path_writes_and_applies_delta_files(engine, loader_path, tmp_path):
    srv = _server(engine)
    client = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    sender = DeltaSender("on")
    try:
        w = _learner(engine)
        for v in (1, 2):
            names = sorted(w)
            client.sync(delta_sync.aupdate_delta(client, sender, [[(n, w[n]) for n in names]],
                                                 v, disk_dir=str(tmp_path)))
            assert _served_equals(engine, w) and sender.stats.delta == (v == 2)
            w = _step(w, 0.01, seed=v)
        assert sorted(p.name for p in tmp_path.glob("delta-*.pt")) == ["delta-v1-b0.pt",
                                                                      "delta-v2-b0.pt"]
        assert (tmp_path / "delta-v2-b0.pt").stat().st_size < (
            tmp_path / "delta-v1-b0.pt").stat().st_size / 3
    finally:
        client.shutdown()
        srv.stop_thread()


def test_hash_base_needs_no_loader(engine):
    srv = _server(engine, loaders=())
    client = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    client.delta = DeltaSender("on", base="hash")
    try:
        w = _learner(engine)
        _sync(client, w, 1)
        w["model.norm.weight"] = w["model.norm.weight"] + 1
        st = _sync(client, w, 2)
        assert st.delta and st.kinds["full"] == 1 and st.kinds["same"] == len(w) - 1
        assert _served_equals(engine, w)
    finally:
        client.shutdown()
        srv.stop_thread()


def test_bf16_weights(tiny_model_dir, loader_path):
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    eng = EmbeddedEngine(tiny_model_dir, dtype="bfloat16", seed=1)
    srv = _server(eng)
    client = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    client.delta = DeltaSender("auto", threshold=0.3)
    try:
        w = _learner(eng, torch.bfloat16)
        _sync(client, w, 1)
        w = _step(w, 0.5, seed=1)
        st = _sync(client, w, 2)  # after a full sync: a delta (share unknown -> measured)
        assert st.delta and _served_equals(eng, w) and st.share() > 0.3
        w = _step(w, 0.01, seed=2)
        st = _sync(client, w, 3)  # last share 0.5 >= 0.3: full, still measured
        assert not st.delta and st.reason.startswith("changed share") and st.share() < 0.02
        w = _step(w, 0.01, seed=3)
        assert _sync(client, w, 4).delta and _served_equals(eng, w)
    finally:
        client.shutdown()
        srv.stop_thread()
