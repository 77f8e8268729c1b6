"""SGLang's `return_routed_experts` through the client and the stand-in server (MoE demo
model): the request field, base64 int32 [prompt + completion - 1, layers, top-k] decoding into
`Sample.routing`, and a server without --enable-return-routed-experts (SGLang 0.5.12 answers
without the field; the client refuses such a server at start with one line)."""

import base64
import json
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from megatron_gspo.rollout.embedded import EmbeddedEngine, RoutingCapture, moe_routers
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.sglang.protocol import decode_routed_experts
from megatron_gspo.rollout.standin.server import StandinServer

BASE = Path(__file__).resolve().parents[2] / "examples" / "moe" / "base"
PROMPT = [1, 40, 45, 50, 51, 52, 2, 10, 1, 60]


@pytest.fixture()
def server(request):
    srv = StandinServer(EmbeddedEngine(str(BASE), dtype="float32", seed=4), model_path=str(BASE),
                        enable_return_routed_experts=request.param).start_in_thread()
    yield srv
    srv.stop_thread()


@pytest.mark.parametrize("server", [True], indirect=True)
def test_client_decodes_routed_experts(server):
    eng = SGLangEngine(server_urls=[server.url], backoff_s=0.01, vocab_size=128,
                       return_routing=True, routing_shape=(2, 2))
    try:
        samples = eng.generate([GenerateRequest(prompt_ids=PROMPT, sampling=SamplingParams(
            n=3, max_new_tokens=6, ignore_eos=True))])
    finally:
        eng.shutdown()
    model = EmbeddedEngine(str(BASE), dtype="float32").model
    for s in samples:
        t = len(s.prompt_ids) + len(s.response_ids)
        assert s.routing.shape == (t - 1, 2, 2) and s.routing.dtype == torch.int32
        cap = RoutingCapture(moe_routers(model))
        with torch.no_grad():
            model(input_ids=torch.tensor([s.tokens[:-1]]))
        cap.end_forward()
        cap.close()
        assert torch.equal(s.routing.sort(-1).values, cap.forwards[0].sort(-1).values)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("server", [False], indirect=True)
def test_server_without_the_flag(server):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True, "return_routed_experts": True}
    out = _post(server.url, body)
    assert "routed_experts" not in out["meta_info"]  # silently absent, as in SGLang 0.5.12
    with pytest.raises(RolloutError, match="no meta_info.routed_experts"):
        decode_routed_experts(out, "sample 0", len(PROMPT) + 3, (2, 2))
    eng = SGLangEngine(server_urls=[server.url], backoff_s=0.01, return_routing=True)
    try:
        with pytest.raises(RolloutError, match="without --enable-return-routed-experts") as e:
            eng.generate([GenerateRequest(prompt_ids=PROMPT)])
        assert "\n" not in str(e.value)
    finally:
        eng.shutdown()


def test_decode_checks_the_shape():
    ids = torch.arange(4 * 2 * 2, dtype=torch.int32) % 8
    b64 = base64.b64encode(ids.numpy().tobytes()).decode()
    out = {"meta_info": {"routed_experts": b64}}
    got = decode_routed_experts(out, "s", 5, (2, 2))
    assert torch.equal(got, ids.reshape(4, 2, 2))
    with pytest.raises(RolloutError, match="expected 5 x 2 x 2"):
        decode_routed_experts(out, "s", 6, (2, 2))
    with pytest.raises(RolloutError, match="not base64"):
        decode_routed_experts({"meta_info": {"routed_experts": "@@@"}}, "s", 5, (2, 2))
