"""Weight sync against the stand-in server, as strict as SGLang 0.5.12: memory tags, weights
lost after a release without CPU backup, one decoded entry per TP rank, and the start check
that tensor sync needs sglang importable unless the servers are stand-ins."""

from __future__ import annotations

import pytest

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.weight_sync_payloads import sglang_importable, tensor_update_payloads

GREEDY = [GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                    ignore_eos=True))]


def _weights(engine):
    return [(k, v.detach().clone()) for k, v in engine.model.named_parameters()]


def test_release_without_cpu_backup_loses_weights_until_pushed(client, standin, engine):
    before = client.generate(GREEDY)[0].response_ids
    saved = _weights(engine)
    client.release_memory()
    with pytest.raises(RolloutError, match="released"):
        client.generate(GREEDY)
    client.resume_memory(["weights"])
    assert standin.lost_weights == {k for k, _ in saved}
    assert all(not p.detach().any() for p in engine.model.parameters())
    with pytest.raises(RolloutError, match="released"):  # KV cache still released
        client.generate(GREEDY)
    client.resume_memory(["kv_cache", "cuda_graph"])
    assert client.generate(GREEDY)[0].response_ids != before  # garbage weights answer
    client.update_weights([saved[:5], saved[5:]], version=2)
    assert not standin.lost_weights
    assert client.generate(GREEDY)[0].response_ids == before
    assert standin.memory_log == ["release kv_cache,weights,cuda_graph", "resume weights",
                                  "resume kv_cache,cuda_graph"]
    assert client.memory_calls == ["release all", "resume weights",
                                   "resume kv_cache,cuda_graph"]


def test_cpu_backup_keeps_weights(engine):
    from megatron_gspo.rollout.standin.server import StandinServer

    srv = StandinServer(engine, weights_cpu_backup=True).start_in_thread()
    eng = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    try:
        before = eng.generate(GREEDY)[0].response_ids
        eng.release_memory()
        eng.resume_memory()
        assert not srv.lost_weights and eng.generate(GREEDY)[0].response_ids == before
    finally:
        eng.shutdown()
        srv.stop_thread()


def test_memory_tags_and_updates_while_released_are_refused(client, standin, engine):
    named = _weights(engine)[:2]
    client.release_memory(["weights"])
    with pytest.raises(RolloutError, match="weights region is released"):
        client.update_weights([named], version=1)
    with pytest.raises(RolloutError, match="'kv_cache', which is not released"):
        client.sync(client.aresume_memory(["kv_cache"]))  # refused, never sent
    with pytest.raises(RolloutError, match="unknown memory tag 'gpu'"):
        client.sync(client.arelease_memory(["gpu"]))
    client.resume_memory(["weights"])
    client.update_weights([named], version=1)
    assert standin.weight_version == "1"


def test_every_tp_rank_decodes_its_own_entry(engine):
    from megatron_gspo.rollout.standin.server import StandinServer

    srv = StandinServer(engine, tp_size=2).start_in_thread()
    eng = SGLangEngine(server_urls=[srv.url], tp_size=2, backoff_s=0.01)
    try:
        named = _weights(engine)[:3]
        eng.update_weights([named], version=4)
        assert srv.weight_version == "4"
        bodies, _ = tensor_update_payloads(named, tp_size=1)
        body = dict(bodies[0], weight_version="5")
        with pytest.raises(RolloutError, match="failed"):  # no answer: the server ended
            eng.sync(eng._post(srv.url, "/update_weights_from_tensor", body))
        assert "one entry per TP rank" in srv.died and srv.weight_version == "4"
    finally:
        eng.shutdown()
        srv.stop_thread()
    srv = StandinServer(engine, tp_size=2).start_in_thread()
    eng = SGLangEngine(server_urls=[srv.url], tp_size=2, backoff_s=0.01)
    try:
        bodies, _ = tensor_update_payloads(named, tp_size=1)
        other, _ = tensor_update_payloads([(n, t + 1) for n, t in named], tp_size=1)
        body = dict(bodies[0], weight_version="5")
        body["serialized_named_tensors"] += other[0]["serialized_named_tensors"]
        with pytest.raises(RolloutError, match="failed"):
            eng.sync(eng._post(srv.url, "/update_weights_from_tensor", body))
        assert "TP rank 1's entry holds other tensors" in srv.died
    finally:
        eng.shutdown()
        srv.stop_thread()


@pytest.mark.skipif(sglang_importable(), reason="sglang is importable here")
def test_tensor_sync_decided_by_where_the_tensors_are(engine, tiny_model_dir, monkeypatch):
    """CPU tensors reach a real (non-stand-in) server without sglang in this environment;
    CUDA tensors without sglang fail the sync with one error before any payload is sent."""
    from aiohttp import web

    from megatron_gspo.loop.server_setup import sglang_engine
    from megatron_gspo.config import load_config
    from megatron_gspo.rollout.standin.server import StandinServer

    srv = StandinServer(engine)

    async def real_server_info(request):  # what SGLang 0.5.12 answers
        return web.json_response({"version": "0.5.12", "tp_size": 1})

    srv.server_info = real_server_info
    srv.start_in_thread()
    eng = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    try:
        eng.update_weights([_weights(engine)[:2]], version=1)
        assert srv.stats["weight_updates"] == 1 and srv.weight_version == "1"
        # CUDA payloads: checked without a GPU
        import megatron_gspo.rollout.weight_sync_payloads as ws

        monkeypatch.setattr(ws, "_has_cuda_tensor", lambda obj: True)
        with pytest.raises(RolloutError, match="version 2: tensor weight sync of CUDA tensors "
                           "needs sglang importable"):
            eng.update_weights([_weights(engine)[:2]], version=2)
        assert srv.stats["weight_updates"] == 1
    finally:
        eng.shutdown()
        srv.stop_thread()
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "rollout.engine=sglang",
                             "rollout.colocate=true", "model.dtype=float32"])
    launched = sglang_engine(cfg, SamplingParams())  # CPU learner: CUDA payloads impossible
    assert launched.weight_sync == "tensor" and launched.spec.dtype == "float32"
