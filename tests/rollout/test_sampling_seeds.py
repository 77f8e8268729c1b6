"""Per-sample sampling seeds (`train.deterministic` with SGLang servers): a seeded sample draws
the same tokens whatever shares its batch and whichever server takes it; the stand-in honours
`sampling_seed` only when started with --enable-deterministic-inference, as SGLang does
(sampling/sampling_batch_info.py); launched servers get that flag except on the CPU engine."""

from __future__ import annotations

import json
import urllib.request

import pytest

from megatron_gspo.rollout.engine import GenerateRequest, SampleSeeds, SamplingParams, sample_seed
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.sglang.launch import LaunchSpec, server_argv

SP = SamplingParams(max_new_tokens=12, temperature=1.3, ignore_eos=True)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _tokens(answer: dict) -> list[int]:
    return [t for _, t, _ in answer["meta_info"]["output_token_logprobs"]]


def test_seeds_are_stable_distinct_and_in_range():
    assert sample_seed(7, 0, 3) == sample_seed(7, 0, 3)
    seeds = {sample_seed(b, c, k) for b in (0, 1) for c in range(3) for k in range(50)}
    assert len(seeds) == 2 * 3 * 50 and all(0 <= s < 2**63 for s in seeds)
    step = SampleSeeds(11)
    first, second = step.next_call(), step.next_call()
    assert first(0) == sample_seed(11, 0, 0) and second(0) == sample_seed(11, 1, 0)
    assert SampleSeeds(11).next_call()(5) == first(5)  # a resumed step: the same seeds


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, True, "3"])
def test_bad_seed_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="sampling.seed"):
        SamplingParams(seed=bad)


def test_seed_goes_into_sglang_sampling_params():
    assert "sampling_seed" not in SP.to_sglang()
    assert SamplingParams(seed=9).to_sglang()["sampling_seed"] == 9


def test_embedded_seeded_row_ignores_its_batch(engine):
    seeded = SamplingParams(max_new_tokens=12, temperature=1.3, ignore_eos=True, seed=42)
    alone = engine.sample_rows([([5, 6, 7], seeded)])[0]
    others = [([9, 10, 11, 12, 13], SP), ([3], SP)]
    engine.generator.manual_seed(1)
    crowded = engine.sample_rows([others[0], ([5, 6, 7], seeded), others[1]])[1]
    assert crowded[0] == alone[0]
    assert crowded[1] == pytest.approx(alone[1], abs=1e-5)
    other_seed = engine.sample_rows([([5, 6, 7], SamplingParams(
        max_new_tokens=12, temperature=1.3, ignore_eos=True, seed=43))])[0]
    assert other_seed[0] != alone[0]  # 12 tokens at T=1.3 over 128 ids: the seed matters


@pytest.fixture()
def deterministic_standin(engine):
    from megatron_gspo.rollout.standin.server import StandinServer

    srv = StandinServer(engine, model_path="tiny", deterministic_inference=True).start_in_thread()
    yield srv
    srv.stop_thread()


def test_standin_honours_sampling_seed_only_when_deterministic(standin, deterministic_standin):
    body = {"input_ids": [5, 6, 7], "return_logprob": True,
            "sampling_params": {**SP.to_sglang(), "sampling_seed": 1234}}
    runs = [_tokens(_post(deterministic_standin.url, body)[1]) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 12
    plain = {tuple(_tokens(_post(standin.url, body)[1])) for _ in range(3)}
    assert len(plain) > 1  # ignored without the flag: the server's one stream moves on
    status, answer = _post(deterministic_standin.url, {
        **body, "sampling_params": {**body["sampling_params"], "sampling_seed": "x"}})
    assert status == 400 and "sampling_seed must be an integer" in json.dumps(answer)


def test_client_seeds_make_two_servers_draw_alike(tiny_model_dir):
    """Two deterministic stand-ins, concurrent requests spread over both: the same step seed
    gives the same samples; the next step's seeds give others."""
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.standin.server import StandinServer

    servers = [StandinServer(EmbeddedEngine(tiny_model_dir, seed=s), model_path="tiny",
                             deterministic_inference=True).start_in_thread() for s in (1, 2)]
    client = SGLangEngine(server_urls=[s.url for s in servers], backoff_s=0.01,
                          request_timeout_s=30)
    reqs = [GenerateRequest([5, 6, 7], SP.with_n(4)), GenerateRequest([8] * 5, SP.with_n(4))]
    try:
        got = []
        for base in (100, 100, 101):
            client.sample_seeds = SampleSeeds(base)
            got.append([s.response_ids for s in client.generate(reqs)])
        assert all(s.stats["samples"] > 0 for s in servers)  # both servers took samples
    finally:
        client.shutdown()
        for s in servers:
            s.stop_thread()
    assert got[0] == got[1]
    assert got[0] != got[2]
    assert len({tuple(r) for r in got[0][:4]}) > 1  # the samples of a group differ


def test_launch_flag_on_gpu_servers_only(caplog):
    gpu = LaunchSpec(model_path="m", deterministic=True)
    assert "--enable-deterministic-inference" in server_argv(gpu, 0, 30000)
    assert "--enable-deterministic-inference" not in server_argv(
        LaunchSpec(model_path="m"), 0, 30000)
    with caplog.at_level("WARNING"):
        cpu = LaunchSpec(model_path="m", deterministic=True, device="cpu")
    assert "--enable-deterministic-inference" not in server_argv(cpu, 0, 30000)
    assert "no deterministic inference" in caplog.text


def test_deterministic_standin_answers_do_not_depend_on_the_batch(deterministic_standin):
    """Log-probs too, bit for bit: a request alone and the same request among concurrent ones of
    other lengths (SGLang's batch-invariant kernels under --enable-deterministic-inference)."""
    from concurrent.futures import ThreadPoolExecutor

    def body(ids, seed):
        return {"input_ids": ids, "return_logprob": True,
                "sampling_params": {**SP.to_sglang(), "sampling_seed": seed}}

    prompts = [[5, 6, 7], [9] * 11, [3, 4], list(range(20, 37)), [8] * 5, [40, 41, 42, 43]]
    alone = [_post(deterministic_standin.url, body(p, 50 + i))[1]["meta_info"]
             for i, p in enumerate(prompts)]
    calls_before = deterministic_standin.stats["generate_calls"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        crowded = list(pool.map(lambda ip: _post(deterministic_standin.url,
                                                 body(ip[1], 50 + ip[0]))[1]["meta_info"],
                                enumerate(prompts)))
    assert deterministic_standin.stats["generate_calls"] == calls_before + len(prompts)
    for a, c in zip(alone, crowded, strict=True):
        assert a["output_token_logprobs"] == c["output_token_logprobs"]
