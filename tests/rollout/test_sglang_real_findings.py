"""What SGLang 0.5.12's real CPU server showed beyond the stand-in (tier `sglang_real`, see
test_sglang_real_server.py), held here against the stand-in and the client so the default
suite sees it: the decoded `text` leaves special tokens out; a request aborted in the waiting
queue answers "Abort in waiting queue" with a short meta_info; a tensor update naming an
unknown stacked part (q_proj, gate_proj, ...) ends a Qwen3 server and is never sent; input-token
log-probs end a CPU server."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import aiohttp
import pytest
import torch

from megatron_gspo.rollout.engine import RolloutError
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.standin.generate import ABORTED, WAITING_ABORTED
from megatron_gspo.rollout.standin.server import StandinServer
from megatron_gspo.rollout.weight_sync_payloads import tensor_update_payloads

TINY_BASE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny", "base")


def _post(url, path, body=None, timeout=30.0):
    async def go():
        async with aiohttp.ClientSession() as s, s.post(
                url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.text()

    return asyncio.run(go())


@pytest.fixture()
def standin():
    srv = StandinServer(EmbeddedEngine(TINY_BASE, seed=3), model_path=TINY_BASE)
    srv.start_in_thread()
    yield srv
    srv.stop_thread()


def test_text_leaves_special_tokens_out(standin):
    tok = standin.decode  # loads the model's tokenizer
    assert tok([2, 42]) == "D" and tok([2, 42], False) == "<|im_end|>D"
    body = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [
        {"max_new_tokens": 24, "ignore_eos": True},
        {"max_new_tokens": 24, "ignore_eos": True, "skip_special_tokens": False}]}
    st, text = _post(standin.url, "/generate", body)
    a, b = json.loads(text)
    assert st == 200 and a["text"] == tok(a["output_ids"]) and b["text"] == tok(
        b["output_ids"], False)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(TINY_BASE)
    assert a["text"] == hf.decode(a["output_ids"], skip_special_tokens=True)


def test_abort_in_the_waiting_queue(standin):
    assert _post(standin.url, "/pause_generation", {"mode": "in_place"})[0] == 200
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_post(standin.url, "/generate", {
        "input_ids": [5, 6], "rid": "w", "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4}})))
    t.start()
    deadline = time.time() + 20
    while not standin._queue and time.time() < deadline:
        time.sleep(0.01)
    assert standin._queue, "the request never reached the waiting queue"
    assert _post(standin.url, "/abort_request", {"rid": "w"})[0] == 200
    t.join(20)
    st, text = out["r"]
    got = json.loads(text)
    assert st == 200 and got["meta_info"]["finish_reason"] == WAITING_ABORTED != ABORTED
    assert sorted(got["meta_info"]) == ["completion_tokens", "e2e_latency", "finish_reason", "id",
                                        "input_token_logprobs", "output_token_logprobs",
                                        "weight_version"]
    assert got["output_ids"] == [] and got["text"] == ""
    _post(standin.url, "/continue_generation", {})


def test_unknown_stacked_names_are_not_sent_and_end_a_qwen3_server(standin):
    w = ("bogus.model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 4))
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01)
    try:
        with pytest.raises(RolloutError, match=r"q_proj.*models/qwen3.py.*not sent"):
            eng.update_weights([[w]], version=1)
        assert eng.health()
        # plain unknown names are skipped by SGLang and answered 200 (the probe catches them)
        eng.update_weights([[("unknown_0", torch.zeros(4))]], version=2)
    finally:
        eng.shutdown()
    assert standin.architecture() == "Qwen3ForCausalLM"
    body = tensor_update_payloads([w], 1)[0][0]
    with pytest.raises(aiohttp.ClientError):  # the server ends without an answer
        _post(standin.url, "/update_weights_from_tensor", body)
    assert "qkv_proj" in standin.died and "models/qwen3.py" in standin.died


def test_llama_skips_unknown_stacked_names(tmp_path):
    cfg = json.load(open(os.path.join(TINY_BASE, "config.json")))
    srv = StandinServer(EmbeddedEngine(TINY_BASE), model_path=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": [
        "LlamaForCausalLM"]}))
    srv.start_in_thread()
    try:
        body = tensor_update_payloads([("x.mlp.gate_proj.weight", torch.zeros(2))], 1)[0][0]
        st, text = _post(srv.url, "/update_weights_from_tensor", body)
        assert st == 200 and json.loads(text)["success"] is True
    finally:
        srv.stop_thread()


def test_input_token_logprobs_end_a_cpu_server():
    srv = StandinServer(EmbeddedEngine(TINY_BASE), model_path=TINY_BASE, device="cpu")
    srv.start_in_thread()
    try:
        st, _ = _post(srv.url, "/generate", {"input_ids": [5, 6], "return_logprob": True,
                                             "sampling_params": {"max_new_tokens": 2}})
        assert st == 200  # output log-probs alone are fine
        with pytest.raises(aiohttp.ClientError):
            _post(srv.url, "/generate", {"input_ids": [5, 6], "return_logprob": True,
                                         "logprob_start_len": 0,
                                         "sampling_params": {"max_new_tokens": 2}})
        assert "NVIDIA driver" in srv.died
    finally:
        srv.stop_thread()
