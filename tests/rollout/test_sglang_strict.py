"""The SGLang client against a stand-in as strict as SGLang 0.5.12 (and sglang-router 0.3.2):
context length, health generation, release while busy, aborts, server_info sizes, api key,
broken answers."""

from __future__ import annotations

import threading
import time

import aiohttp
import pytest

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.sglang.protocol import parse_generate_output
from megatron_gspo.rollout.standin.router import StandinRouter
from megatron_gspo.rollout.standin.server import StandinServer


def _reqs(prompt_len=3, max_new=6, n=2):
    return [GenerateRequest([5] * prompt_len, SamplingParams(max_new_tokens=max_new, n=n))]


def _get(url, path, headers=None):
    import asyncio

    async def go():
        async with aiohttp.ClientSession() as s, s.get(url + path, headers=headers) as r:
            return r.status, await r.text()

    return asyncio.run(go())


def _post(url, path, body, headers=None):
    import asyncio

    async def go():
        async with aiohttp.ClientSession() as s, s.post(url + path, json=body,
                                                        headers=headers) as r:
            return r.status, await r.text()

    return asyncio.run(go())


# --------------------------------------------------------------------- context length (13.8)
def test_standin_answers_400_for_over_long_requests_like_sglang(standin):
    body = {"input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 10}}
    status, text = _post(standin.url, "/generate", body)
    assert status == 400
    assert "exceeds the model's maximum context length of 256 tokens" in text
    status, text = _post(standin.url, "/generate", {"input_ids": [5] * 256})
    assert status == 400 and "longer than the model's context length (256 tokens)" in text


def test_over_long_sample_is_a_per_sample_failure_not_the_run(standin):
    # The stand-in's /server_info carries no context length (none was passed) and its model
    # path is not a local directory: the client cannot check, the server answers 400.
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01)
    try:
        bad = _reqs(prompt_len=250, max_new=10, n=2)
        good = _reqs(prompt_len=3, max_new=4, n=2)
        out = eng.generate(bad + good)
        assert len(out) == 4
        for s in out[:2]:
            assert s.finish_reason == "abort" and s.num_trainable == 0
            assert "context length" in s.metadata["rollout_error"]
        assert all(s.finish_reason in ("stop", "length") and s.num_trainable > 0
                   for s in out[2:])
        assert eng.metrics["failed"] == 2
        assert eng.health()
    finally:
        eng.shutdown()


def test_rid_of_a_request_refused_for_its_length_stays_taken(standin):
    """SGLang 0.5.12 registers a request's rid before its length check and never drops it
    when the check refuses it: that rid gets 400 "Duplicate request ID" for good, while a rid
    of a request that ran is free again. A second engine in the same process (or a restarted
    run whose process id repeats) must not reuse the first one's rids."""
    long = {"input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 10}}
    short = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    assert _post(standin.url, "/generate", {**long, "rid": "r1"})[0] == 400
    assert _post(standin.url, "/generate", {**short, "rid": "r1"}) == (
        400, '{"error": {"message": "Duplicate request ID detected: r1"}}')
    for _ in range(2):
        assert _post(standin.url, "/generate", {**short, "rid": "r2"})[0] == 200
    for _ in range(2):  # the same slot of the first batch of two engines
        eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, max_retries=0)
        try:
            bad, good = eng.generate(_reqs(prompt_len=250, max_new=10, n=1) +
                                     _reqs(prompt_len=3, max_new=4, n=1))
            assert "context length" in bad.metadata["rollout_error"]
            assert "rollout_error" not in good.metadata and good.response_ids
        finally:
            eng.shutdown()


def test_client_caps_max_new_tokens_to_the_context(standin):
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, context_length=256)
    try:
        calls = standin.stats["generate_calls"]
        out = eng.generate([GenerateRequest([5] * 250, SamplingParams(
            max_new_tokens=50, ignore_eos=True, n=2))] + _reqs(prompt_len=256, n=1))
        assert [len(s.response_ids) for s in out[:2]] == [6, 6]
        assert all(s.finish_reason == "length" for s in out[:2])
        assert out[2].finish_reason == "abort" and "context length" in \
            out[2].metadata["rollout_error"]
        assert standin.stats["generate_calls"] == calls + 2  # the too-long prompt never sent
        assert eng.metrics["capped"] == 2 and eng.metrics["failed"] == 1
    finally:
        eng.shutdown()


# ------------------------------------------------------------ server_info sizes (13.11)
def test_attached_server_sizes_are_read_and_mismatch_refused(engine):
    srv = StandinServer(engine, tp_size=2).start_in_thread()
    try:
        status, text = _get(srv.url, "/server_info")
        assert status == 200 and '"tp_size": 2' in text and '"dp_size": 1' in text
        eng = SGLangEngine(server_urls=[srv.url], tp_size=1)
        with pytest.raises(RolloutError, match=r"tp_size=2.*rollout.tp_size=1"):
            eng.generate(_reqs())
        eng.shutdown()
        srv.dp_size = 2
        eng = SGLangEngine(server_urls=[srv.url], tp_size=2)
        with pytest.raises(RolloutError, match=r"dp_size=2"):
            eng.generate(_reqs())
        eng.shutdown()
    finally:
        srv.stop_thread()


# ------------------------------------------------------------- finish reason abort (13.12)
def test_aborted_samples_are_retried_then_masked_and_counted(standin):
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, max_retries=2)
    try:
        standin.faults.abort = 2
        out = eng.generate(_reqs(n=2))
        assert all(s.finish_reason != "abort" and s.num_trainable > 0 for s in out)
        assert eng.metrics["aborted"] == 2
        standin.faults.abort = 100
        out = eng.generate(_reqs(n=1))
        assert out[0].finish_reason == "abort" and out[0].num_trainable == 0
        assert "abort" in out[0].metadata["rollout_error"]
        assert eng.metrics["aborted"] == 5 and eng.metrics["failed"] == 1
    finally:
        standin.faults.abort = 0
        eng.shutdown()


# ---------------------------------------------- health generation, release while busy (13.3)
def test_health_generates_and_fails_while_released(engine):
    srv = StandinServer(engine).start_in_thread()
    quiet = StandinServer(engine, health_generation=False).start_in_thread()
    try:
        calls = srv.stats["generate_calls"]
        assert _get(srv.url, "/health")[0] == 200
        assert srv.stats["health_generations"] == 1 and srv.stats["generate_calls"] == calls
        srv.released = quiet.released = True
        assert _get(srv.url, "/health")[0] == 503
        assert _get(srv.url, "/health_generate")[0] == 503
        assert _get(quiet.url, "/health")[0] == 200  # env turned the generation off
        assert _get(quiet.url, "/health_generate")[0] == 503
    finally:
        srv.stop_thread()
        quiet.stop_thread()


def test_release_while_busy_is_refused(standin):
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01)
    standin.faults.slow, standin.faults.delay_s = 1, 1.5
    t = threading.Thread(target=eng.generate, args=(_reqs(n=1),))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while standin.stats["generate_calls"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RolloutError, match="in flight"):  # refused, never sent
            eng.release_memory()
        assert standin.faults.crash is False and getattr(standin, "died", None) is None
        with pytest.raises(aiohttp.ClientError):  # SGLang's scheduler asserts: the server ends
            _post(standin.url, "/release_memory_occupation", {})
        assert "only when server is idle" in standin.died
    finally:
        t.join(timeout=20)
        eng.shutdown()


def test_router_health_checks_with_colocated_release(engine):
    """Launched servers run with /health generation off: the router's health checks neither
    generate on a released server (nor keep it busy, which refuses the release) nor mark it
    unhealthy. A server with the generation on fails them while released."""
    quiet = StandinServer(engine, health_generation=False).start_in_thread()
    loud = StandinServer(engine).start_in_thread()
    router = StandinRouter([quiet.url, loud.url], health_check_interval_s=0.02,
                           health_check_timeout_s=2).start_in_thread()
    eng = SGLangEngine(server_urls=[quiet.url], router_url=router.url, backoff_s=0.01)
    try:
        assert len(eng.generate(_reqs(n=2))) == 2
        for _ in range(20):  # many releases while the router polls: never refused
            eng.release_memory()
            assert eng.health()  # while released: no generation is asked of the servers
            eng.resume_memory()
        eng.release_memory()
        loud.released = True
        n = router.health_checks
        deadline = time.monotonic() + 10
        while router.health_checks < n + 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert router.healthy[quiet.url] and not router.healthy[loud.url]
        assert quiet.stats["health_generations"] == 0 < loud.stats["health_generations"]
        eng.resume_memory()
        loud.released = False
        assert len(eng.generate(_reqs(n=2))) == 2
    finally:
        eng.shutdown()
        router.stop_thread()
        quiet.stop_thread()
        loud.stop_thread()


# ----------------------------------------------------------- aborts to workers (13.7)
def test_router_has_no_abort_and_timeouts_abort_on_the_workers(engine):
    worker = StandinServer(engine).start_in_thread()
    router = StandinRouter([worker.url]).start_in_thread()
    eng = SGLangEngine(server_urls=[worker.url], router_url=router.url, backoff_s=0.01,
                       request_timeout_s=1.0)
    try:
        assert _post(router.url, "/abort_request", {"rid": "x"})[0] == 404
        eng.generate(_reqs(n=1))  # warm: the next answers come well within the timeout
        worker.faults.slow, worker.faults.delay_s = 1, 2.0
        out = eng.generate(_reqs(n=1))
        assert len(out) == 1 and eng.metrics["retries"] == 1
        assert len(worker.aborts) == 1 and worker.aborts[0].startswith("mg-")
    finally:
        eng.shutdown()
        router.stop_thread()
        worker.stop_thread()


# ------------------------------------------------------------------- api key (21.10)
def test_api_key_is_enforced_and_sent_on_every_request(engine):
    srv = StandinServer(engine, api_key="s3cret").start_in_thread()
    try:
        assert _get(srv.url, "/health")[0] == 200  # health is open, as upstream
        assert _post(srv.url, "/generate", {"input_ids": [1]})[0] == 401
        assert _get(srv.url, "/model_info", {"Authorization": "Bearer wrong"})[0] == 401
        eng = SGLangEngine(server_urls=[srv.url])
        with pytest.raises(RolloutError, match="401") as e:
            eng.generate(_reqs())
        assert "s3cret" not in str(e.value)
        eng.shutdown()
        eng = SGLangEngine(server_urls=[srv.url], api_key="s3cret")
        assert len(eng.generate(_reqs())) == 2
        state = [(k, v.clone()) for k, v in engine.model.state_dict().items()]
        eng.update_weights([state], version=2)
        eng.release_memory()
        eng.resume_memory()
        assert srv.weight_version == "2" and len(eng.generate(_reqs())) == 2
        eng.shutdown()
    finally:
        srv.stop_thread()


# ------------------------------------------------------------- broken answers (21.9)
@pytest.mark.parametrize("fault", ["cut", "garbage", "nested", "bad_ids"])
def test_broken_answers_are_retried(standin, fault):
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, max_retries=2,
                       vocab_size=128)
    try:
        setattr(standin.faults, fault, 2)
        out = eng.generate(_reqs(n=1))
        assert len(out) == 1 and out[0].num_trainable > 0
        assert eng.metrics["retries"] == 2
        setattr(standin.faults, fault, 100)
        with pytest.raises(RolloutError, match=standin.url):
            eng.generate(_reqs(n=1))
    finally:
        setattr(standin.faults, fault, 0)
        eng.shutdown()


def test_malformed_token_entries_are_refused():
    def out(entries, n=None):
        return {"meta_info": {"output_token_logprobs": entries,
                              "finish_reason": {"type": "stop"}}}

    assert parse_generate_output(out([[-0.1, 3, None]]), "s", 4, 8)[0] == [3]
    for entries, msg in [([[-0.1, -1, None]], "token id -1"),
                         ([[-0.1, 8, None]], "token id 8"),
                         ([[-0.1, 2.0, None]], "token id 2.0"),
                         ([[-0.1, True, None]], "token id True"),
                         ([["x", 2, None]], "log-prob 'x'"),
                         ([[-0.1, 2, None]] * 5, "5 tokens returned for max_new_tokens=4")]:
        with pytest.raises(RolloutError, match=msg):
            parse_generate_output(out(entries), "sample 0 from http://h:1", 4, 8)


def test_group_sampler_drops_groups_with_failed_samples(standin):
    from megatron_gspo.rollout.groups import GroupSampler

    def prompts():  # every other prompt is too long for the context
        i = 0
        while True:
            yield GenerateRequest([5] * (300 if i % 2 else 3), prompt=f"p{i}")
            i += 1

    def score(samples):
        for s in samples:
            s.reward = float(len(s.response_ids))

    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, context_length=256)
    try:
        sampler = GroupSampler(eng, 2, score, SamplingParams(max_new_tokens=4), 1.0)
        samples, m = sampler.collect(prompts(), num_groups=2)
    finally:
        eng.shutdown()
    assert len(samples) == 4 and all("rollout_error" not in s.metadata for s in samples)
    assert {s.prompt for s in samples} == {"p0", "p2"}
    assert m["groups_failed"] == 1 and m["samples_failed"] == 2 and m["groups_kept"] == 2


def test_agent_turn_the_engine_gave_up_on_is_masked():
    """An episode turn that comes back as a per-sample failure (finish abort, loss mask 0)
    ends the episode without training on that turn's tokens."""
    from megatron_gspo.agent.envs import CalculatorEnv
    from megatron_gspo.agent.runner import EpisodeLimits, EpisodeRunner
    from tests.agent.agent_helpers import ScriptedEngine, ToyTokenizer

    class GivesUp(ScriptedEngine):
        async def agenerate(self, requests):
            out = await super().agenerate(requests)
            for s in out:
                s.finish_reason, s.loss_mask = "abort", [0] * len(s.response_ids)
                s.metadata["rollout_error"] = "aborted by http://h:1 3 times"
            return out

    tok = ToyTokenizer()
    eng = GivesUp(lambda p, k: [tok.ids[c] for c in "The answer"])
    runner = EpisodeRunner(eng, tok, lambda: CalculatorEnv(),
                           sampling=SamplingParams(max_new_tokens=64),
                           limits=EpisodeLimits(max_new_tokens_per_turn=200))
    s = runner.run_batch_sync([{"prompt": "What is 2*3?", "label": "6"}], n_per_prompt=1)[0]
    assert s.finish_reason == "abort" and s.metadata["stop_reason"] == "engine_abort"
    assert len(s.response_ids) == 10 and s.num_trainable == 0
    assert "aborted" in s.metadata["rollout_error"]


def test_rollout_phase_counts_failed_and_aborted_samples(standin):
    from types import SimpleNamespace

    from megatron_gspo.loop import phases
    from megatron_gspo.config import config_from_dict

    class Tok:
        eos_token_id = 1

        def get_vocab(self):
            return {}

    cfg = config_from_dict({"model": {"path": "m"}, "rollout": {
        "engine": "sglang", "server_urls": [standin.url], "colocate": False, "group_size": 2,
        "max_new_tokens": 4}, "train": {"prompts_per_step": 2}})
    rows = iter([SimpleNamespace(prompt_ids=[5] * (300 if i == 1 else 3), prompt=f"p{i}",
                                 label=None, row=i) for i in range(10)])
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, context_length=256)
    standin.faults.abort = 1

    def score(samples):
        for s in samples:
            s.reward = float(len(s.response_ids))

    try:
        samples, m = phases.rollout(cfg, eng, rows, score, Tok(), step=0)
    finally:
        standin.faults.abort = 0
        eng.shutdown()
    assert len(samples) == 4 and m["rollout/samples_failed"] == 2.0
    assert m["rollout/groups_failed"] == 1.0 and m["rollout/engine_aborted_total"] == 1.0
    assert m["rollout/engine_failed_total"] == 2.0


def test_group_sampler_names_the_failure_when_every_group_fails(standin):
    from megatron_gspo.rollout.groups import GroupSampler

    prompts = iter([GenerateRequest([5] * 300, prompt=f"p{i}") for i in range(20)])
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, context_length=256)
    try:
        sampler = GroupSampler(eng, 2, lambda s: None, SamplingParams(max_new_tokens=4), 1.0)
        with pytest.raises(RolloutError, match=r"every one of 4 sampled groups has a failed "
                                               r"sample.*300 tokens does not fit .* 256"):
            sampler.collect(prompts, num_groups=1)
    finally:
        eng.shutdown()
