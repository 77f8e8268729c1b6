"""SGLang client against the stand-in server over real HTTP: answers, weight sync, faults."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from megatron_gspo.rollout.embedded import build_hf_model, sequence_logprobs
from megatron_gspo.rollout.sglang.client import SGLangEngine, parse_generate_output


def _batch(n=3):
    return [
        GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=10, temperature=0.9, n=n),
                        label="a"),
        GenerateRequest([8] * 6, SamplingParams(max_new_tokens=7, temperature=1.2, top_p=0.9,
                                                n=n, stop_token_ids=(2, 3, 4, 5, 6))),
    ]


def _check(samples, reqs, model):
    n = sum(r.sampling.n for r in reqs)
    assert [s.index for s in samples] == list(range(n))
    k = 0
    for g, r in enumerate(reqs):
        for _ in range(r.sampling.n):
            s = samples[k]
            k += 1
            assert s.group_index == g and s.prompt_ids == r.prompt_ids and s.label == r.label
            ref = sequence_logprobs(model, s.prompt_ids, s.response_ids, r.sampling.temperature)
            torch.testing.assert_close(torch.tensor(s.rollout_logprobs), ref, atol=1e-5, rtol=0)
            stops = set(r.sampling.stop_token_ids) | {1}
            if s.finish_reason == "stop":
                assert s.response_ids[-1] in stops
            else:
                assert s.finish_reason == "length"
                assert len(s.response_ids) == r.sampling.max_new_tokens
                assert not stops & set(s.response_ids)


def test_generate_tokens_logprobs_finish_reasons(client, standin, engine):
    reqs = _batch(n=4)
    samples = client.generate(reqs)
    _check(samples, reqs, engine.model)
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    assert standin.stats["generate_calls"] == 8  # one request per sample
    assert client.health()


def test_weight_update_from_tensor_changes_answers(client, standin, engine, tiny_config):
    greedy = [GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                        ignore_eos=True))]
    before = client.generate(greedy)[0]
    assert before.weight_version == 0
    torch.manual_seed(5)
    new = build_hf_model(tiny_config, dtype="bfloat16")  # a bf16 learner export
    named = [(k, v.clone()) for k, v in new.state_dict().items()]
    named[0] = (named[0][0], named[0][1].float())  # mixed dtypes -> one flattened bucket each
    client.update_weights([named[:4], named[4:]], version=3)
    assert client.weight_version == 3 and standin.weight_version == "3"
    assert standin.stats["weight_updates"] == 3 and standin.stats["flushes"] == 1
    for k, v in named:
        torch.testing.assert_close(engine.model.state_dict()[k], v.float())
    after = client.generate(greedy)[0]
    assert after.weight_version == 3 and after.response_ids != before.response_ids


def test_faults_are_retried_each_sample_exactly_once(client, standin, engine):
    standin.faults.error_5xx = 3
    standin.faults.drop = 2
    reqs = _batch(n=3)
    samples = client.generate(reqs)
    _check(samples, reqs, engine.model)
    assert client.metrics["retries"] == 5
    assert len({id(s) for s in samples}) == len(samples) == 6


def test_slow_server_times_out_and_retries(standin, engine):
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, request_timeout_s=0.5)
    standin.faults.slow, standin.faults.delay_s = 2, 2.0
    try:
        samples = eng.generate(_batch(n=2))
    finally:
        eng.shutdown()
    assert len(samples) == 4 and eng.metrics["retries"] == 2


def test_unrecoverable_and_bad_requests_fail_clearly(standin):
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, max_retries=2)
    try:
        standin.faults.error_5xx = 100
        with pytest.raises(RolloutError, match=r"failed 3 times; last error: .*HTTP 503"):
            eng.generate(_batch(n=1))
        standin.faults.error_5xx = 0
        bad = [GenerateRequest([1, 2], SamplingParams(max_new_tokens=3))]
        bad[0].prompt_ids = []
        with pytest.raises(ValueError, match="empty prompt_ids"):
            eng.generate(bad)
        with pytest.raises(RolloutError, match="HTTP 400"):
            eng.sync(eng._post(standin.url, "/standin/faults", {"nope": 1}))
    finally:
        eng.shutdown()
    with pytest.raises(RolloutError, match="shut down"):
        eng.sync(eng.astart())


def test_two_servers_share_load(engine, tiny_model_dir):
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.standin.server import StandinServer

    a = StandinServer(engine).start_in_thread()
    b = StandinServer(EmbeddedEngine(tiny_model_dir, seed=1)).start_in_thread()
    eng = SGLangEngine(server_urls=[a.url, b.url], backoff_s=0.01)
    try:
        b.faults.crash = True  # b dies: every sample must still arrive, from a
        samples = eng.generate(_batch(n=4))
        assert len(samples) == 8 and all(s.metadata["server"] == a.url for s in samples)
        assert not eng.health()
    finally:
        eng.shutdown()
        a.stop_thread()
        b.stop_thread()


def test_memory_disk_update_and_control_endpoints(client, standin, engine, tiny_model_dir):
    client.release_memory()
    assert standin.released
    with pytest.raises(RolloutError, match="memory is released"):
        client.generate(_batch(n=1))
    client.resume_memory()
    assert not standin.released
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(1.0)
    client.sync(client.aupdate_weights_from_disk(tiny_model_dir, 9))
    assert client.weight_version == 9
    s = client.generate(_batch(n=1))
    assert all(x.weight_version == 9 for x in s)
    from safetensors.torch import load_file

    disk = load_file(f"{tiny_model_dir}/model.safetensors")
    for k, v in disk.items():
        torch.testing.assert_close(engine.model.state_dict()[k], v)
    with pytest.raises(RolloutError, match="Failed to update weights"):
        client.sync(client.aupdate_weights_from_disk("/nonexistent", 10))
    assert client.weight_version == 9


def test_parse_generate_output_errors():
    ok = {"meta_info": {"output_token_logprobs": [[-0.5, 7, None]],
                        "finish_reason": {"type": "length", "length": 1}, "weight_version": "4"}}
    assert parse_generate_output(ok, "x") == ([7], [-0.5], "length", "4")
    with pytest.raises(RolloutError, match="no meta_info"):
        parse_generate_output({"text": "hi"}, "sample 3")
    with pytest.raises(RolloutError, match="output_token_logprobs"):
        parse_generate_output({"meta_info": {"finish_reason": {"type": "stop"}}}, "s")
    with pytest.raises(RolloutError, match="finish_reason"):
        parse_generate_output({"meta_info": {"output_token_logprobs": [],
                                             "finish_reason": {"type": "weird"}}}, "s")


def test_shutdown_aborts_a_running_generate(standin):
    import threading

    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01)
    standin.faults.slow, standin.faults.delay_s = 100, 1.0
    errors = []

    def run():
        try:
            eng.generate(_batch(n=2))
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    import time

    deadline = time.monotonic() + 10
    while standin.stats["generate_calls"] < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    eng.shutdown()
    t.join(timeout=10)
    standin.faults.slow = 0
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RolloutError)
    assert "shut down" in str(errors[0])


def test_router_url_gets_generation_workers_get_weights(engine, tiny_model_dir):
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.standin.server import StandinServer

    worker = StandinServer(engine).start_in_thread()
    router = StandinServer(EmbeddedEngine(tiny_model_dir, seed=2)).start_in_thread()
    eng = SGLangEngine(server_urls=[worker.url], router_url=router.url + "/")
    try:
        samples = eng.generate(_batch(n=2))
        assert {s.metadata["server"] for s in samples} == {router.url}
        assert worker.stats["generate_calls"] == 0
        eng.update_weights([[(k, v.clone()) for k, v in engine.model.state_dict().items()]], 4)
        assert worker.stats["weight_updates"] == 1 and router.stats["weight_updates"] == 0
    finally:
        eng.shutdown()
        worker.stop_thread()
        router.stop_thread()


def test_health_check_lost_as_a_batch_finishes_is_asked_once_more(engine, monkeypatch, caplog):
    """SGLang 0.5.12 answers a health request that lands right after a batch only at the end of
    the next batch (503 after its health timeout when none runs): the client asks once more,
    and says why a server is not healthy when the second one fails too."""
    import asyncio
    import logging
    import time

    import aiohttp

    from megatron_gspo.rollout.standin.server import StandinServer

    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.5")  # read at start, as upstream
    srv = StandinServer(engine).start_in_thread()
    eng = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    caplog.set_level(logging.INFO, logger="megatron_gspo.rollout.sglang.client")
    try:
        assert len(eng.generate(_batch(n=1))) == 2
        srv.faults.health_race = 1
        n0 = srv.stats["health_generations"]
        assert eng.health()
        assert srv.stats["health_generations"] == n0 + 2
        assert "HTTP 503" in caplog.text and "asked once more" in caplog.text
        srv.faults.health_race = 2
        assert not eng.health()
        assert "SGLang server not healthy" in caplog.text

        async def queued_then_a_batch():  # the queued request is answered by the next batch
            async with aiohttp.ClientSession() as s:
                health = asyncio.ensure_future(s.get(srv.url + "/health_generate"))
                await asyncio.sleep(0.05)
                t0 = time.monotonic()
                async with s.post(srv.url + "/generate", json={
                        "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}) as r:
                    assert r.status == 200
                async with await health as r:
                    return r.status, time.monotonic() - t0

        srv.faults.health_race = 1
        status, waited = asyncio.run(queued_then_a_batch())
        assert status == 200 and waited < 0.5
    finally:
        eng.shutdown()
        srv.stop_thread()
