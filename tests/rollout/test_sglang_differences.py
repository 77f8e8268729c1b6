"""Where SGLang 0.5.12's real server (measured on CPU) differs from what the client assumed and
from the stand-in: dtype always explicit, the CPU engine's launch, prompt ids and weight
payloads that would end a server never sent (and the stand-in ending the same way), the sync
probe catching a sync that changed nothing, the stand-in's smaller answers, and the shared
memory manager of CPU payloads started away from the client's stderr."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
import torch

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.sglang.launch import LaunchSpec, server_argv
from megatron_gspo.rollout.standin.server import StandinServer
from megatron_gspo.rollout.weight_sync_payloads import tensor_update_payloads

TINY_BASE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny", "base")


def _raw(url, path, body=None, method="POST", timeout=10.0):
    async def go():
        async with aiohttp.ClientSession() as s, s.request(
                method, url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.text()

    return asyncio.run(go())


def test_server_dtype_always_explicit():
    from megatron_gspo.rollout.sglang.protocol import served_dtype

    argv = server_argv(LaunchSpec(model_path="m"), 0, 30000)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    with pytest.raises(ValueError, match="learner's export dtype"):
        LaunchSpec(model_path="m", dtype="auto")
    # what the real server does with auto (and the stand-in now too)
    assert served_dtype("auto", {"dtype": "float32", "model_type": "qwen3"}) == "float16"
    assert served_dtype("auto", {"torch_dtype": "bfloat16"}) == "bfloat16"
    assert served_dtype("float32", {"dtype": "bfloat16"}) == "float32"


def test_cpu_engine_launch(tmp_path):
    from megatron_gspo.loop.server_setup import sglang_engine
    from megatron_gspo.rollout.sglang.launch import cpu_server_env
    from megatron_gspo.config import ConfigError, load_config

    py = tmp_path / "inst" / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("")
    with pytest.raises(ValueError, match="no .*stub/libcuda.so.1"):
        cpu_server_env(str(py))
    (tmp_path / "inst" / "stub").mkdir()
    (tmp_path / "inst" / "stub" / "libcuda.so.1").write_text("")
    env = cpu_server_env(str(py), {"LD_LIBRARY_PATH": "/x"})
    assert env == {"SGLANG_USE_CPU_ENGINE": "1",
                   "LD_LIBRARY_PATH": f"{tmp_path / 'inst' / 'stub'}:/x"}
    cfg = load_config(None, [f"model.path={TINY_BASE}", "rollout.engine=sglang",
                             "rollout.colocate=true", "model.dtype=float32",
                             f"rollout.sglang_python={py}", "rollout.sglang_device=cpu"])
    spec = sglang_engine(cfg, SamplingParams()).spec
    argv = server_argv(spec, 0, 30000)
    assert argv[0] == str(py) and spec.env["SGLANG_USE_CPU_ENGINE"] == "1"
    for flag in ("--disable-overlap-schedule", "--disable-cuda-graph"):
        assert flag in argv
    assert argv[argv.index("--device") + 1] == "cpu"
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
    assert argv[argv.index("--max-total-tokens") + 1] == "8192"
    assert "--enable-memory-saver" not in argv  # torch_memory_saver needs CUDA
    (tmp_path / "inst" / "stub" / "libcuda.so.1").unlink()
    with pytest.raises(ConfigError, match="scripts/sglang_cpu.sh"):
        sglang_engine(cfg, SamplingParams())


def test_prompt_ids_outside_the_vocabulary_never_sent(standin):
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, vocab_size=128)
    try:
        sp = SamplingParams(max_new_tokens=4)
        s = eng.generate([GenerateRequest([5, 128], sp), GenerateRequest([-1, 3], sp),
                          GenerateRequest([5, 6], sp)])
        assert "id 128 at position 1 is outside the vocabulary" in s[0].metadata["rollout_error"]
        assert "id -1 at position 0" in s[1].metadata["rollout_error"]
        assert s[2].response_ids and standin.stats["samples"] == 1
    finally:
        eng.shutdown()
    with pytest.raises(aiohttp.ClientError):  # SGLang's embedding raises: the server ends
        _raw(standin.url, "/generate", {"input_ids": [5, 128]})
    assert "IndexError" in standin.died


class Foreign:  # a class outside SGLang's unpickler allow-list
    pass


def test_payloads_that_would_end_the_server_are_not_sent(engine, tiny_model_dir):
    from megatron_gspo.rollout.weight_sync_payloads import payload_error


    good = tensor_update_payloads([("model.norm.weight", torch.ones(32))], 1)[0][0]
    assert payload_error(good["serialized_named_tensors"][0]) is None
    assert "not base64" in payload_error("not base64!")
    blocked = base64.b64encode(pickle.dumps({"x": Foreign()})).decode()
    assert "Blocked unsafe class loading" in payload_error(blocked)
    for bad, why in ((blocked, "Blocked unsafe"), ("@@", "not base64")):
        srv = StandinServer(engine, model_path=tiny_model_dir).start_in_thread()
        eng = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
        try:
            with pytest.raises(RolloutError, match=f"{why}.*not sent"):
                eng.sync(eng.apost_tensor_update([[bad]], None, 1))
            eng.sync(eng.astart())
            with pytest.raises(RolloutError, match="shape.*not sent"):  # from the checkpoint
                eng.update_weights([[("model.norm.weight", torch.ones(7))]], version=1)
            assert eng.health() and srv.stats["weight_updates"] == 0
            with pytest.raises(aiohttp.ClientError):  # sent anyway: the stand-in ends
                _raw(srv.url, "/update_weights_from_tensor",
                     {"serialized_named_tensors": [bad]})
            assert srv.died
        finally:
            eng.shutdown()
            srv.stop_thread()
    srv = StandinServer(engine).start_in_thread()
    try:
        body = tensor_update_payloads([("model.norm.weight", torch.ones(7))], 1)[0][0]
        with pytest.raises(aiohttp.ClientError):
            _raw(srv.url, "/update_weights_from_tensor", body)
        assert "AssertionError: model.norm.weight has shape (7,)" in srv.died
    finally:
        srv.stop_thread()


def test_unreachable_master_refused_and_blocks_the_standin(standin, monkeypatch):
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01)
    try:
        with pytest.raises(RolloutError, match="cannot listen on 10.255.255.1"):
            eng.sync(eng.aconnect_distributed("10.255.255.1", 29511, backend="gloo"))
    finally:
        eng.shutdown()
    monkeypatch.setenv("STANDIN_GROUP_TIMEOUT_S", "4")
    body = {"master_address": "10.255.255.1", "master_port": 29511, "rank_offset": 1,
            "world_size": 2, "group_name": "g", "backend": "gloo"}
    t = threading.Thread(target=lambda: _raw(standin.url, "/init_weights_update_group", body,
                                             timeout=30))
    t.start()
    time.sleep(0.5)
    with pytest.raises(asyncio.TimeoutError):  # the whole server waits, /health included
        _raw(standin.url, "/health", method="GET", timeout=1.5)
    t.join(30)


def test_sync_probe_catches_a_sync_that_changed_nothing(engine, tiny_model_dir):
    from megatron_gspo.config import load_config
    from megatron_gspo.loop.weight_sync_phase import verify_sync
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from tests.rollout._sglang_real import RecomputeLearner

    srv = StandinServer(engine, model_path=tiny_model_dir).start_in_thread()
    eng = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    learner_side = EmbeddedEngine(tiny_model_dir)

    cfg = load_config(None, ["model.dtype=float32", "rollout.temperature=0.8"])
    new = [(k, v.detach() + 0.1) for k, v in learner_side.model.named_parameters()]
    learner_side.load_buckets([new], 1)
    try:
        eng.update_weights([new], version=1)
        assert verify_sync(RecomputeLearner(learner_side.model), eng, cfg, 1) < 1e-4

        class Offloaded(RecomputeLearner):  # rollout.offload_learner: weights, grads away
            def __init__(self):
                super().__init__(learner_side.model)
                self.away, self.calls = ["grads", "weights"], []

            def offloaded_parts(self):
                return list(self.away)

            def onload(self, parts=None):
                self.calls.append("on")
                self.away = [p for p in self.away if p not in parts]

            def offload(self, parts):
                self.calls.append("off")
                self.away = sorted(set(self.away) | set(parts))

            def forward_logprobs(self, samples, temperature):
                if "weights" in self.away:  # as Learner._micro_batches: the forward reads
                    raise RuntimeError("learner weights offloaded")  # the weights alone
                return super().forward_logprobs(samples, temperature)

        off = Offloaded()
        assert verify_sync(off, eng, cfg, 1) < 1e-4
        assert off.away == ["grads", "weights"] and off.calls == ["on", "off"]
        newer = [(k, v + 0.1) for k, v in new]
        learner_side.load_buckets([newer], 2)
        eng.update_weights([[(f"unknown_{i}", v) for i, (_, v) in enumerate(newer)]],
                          version=2)  # 200, no-op
        with pytest.raises(RolloutError, match="weight sync to version 2 not verified"):
            verify_sync(RecomputeLearner(learner_side.model), eng, cfg, 2)
    finally:
        eng.shutdown()
        srv.stop_thread()


def test_standin_answers_as_sglang(engine):
    from megatron_gspo.rollout.standin.generate import ABORTED, EXTRA_META
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    srv = StandinServer(EmbeddedEngine(TINY_BASE), model_path=TINY_BASE).start_in_thread()
    try:
        st, text = _raw(srv.url, "/generate", {"input_ids": [[5, 6], [7]], "rid": "r",
                                               "return_logprob": True, "sampling_params": {
                                                   "max_new_tokens": 3, "ignore_eos": True}})
        out = json.loads(text)
        assert [o["meta_info"]["id"] for o in out] == ["r_0", "r_1"]
        assert all(isinstance(o["text"], str) and set(EXTRA_META) <= set(o["meta_info"])
                   for o in out)
        assert out[0]["meta_info"]["output_token_logprobs_length"] == 3
        assert _raw(srv.url, "/nope", method="GET")[0] == 404
        assert json.loads(_raw(srv.url, "/nope", method="GET")[1]) == {"detail": "Not Found"}
        st, text = _raw(srv.url, "/continue_generation")
        assert st == 400 and json.loads(text)["type"] == "Bad Request"
        assert _raw(srv.url, "/flush_cache")[1].startswith("Cache flushed.\nPlease check")
        srv.faults.abort = 1
        st, text = _raw(srv.url, "/generate", {"input_ids": [5], "sampling_params": {}})
        assert json.loads(text)["meta_info"]["finish_reason"] == ABORTED
        assert ABORTED["message"] == "Aborted" and {"status_code", "err_type"} <= set(ABORTED)
        body = tensor_update_payloads([("model.norm.weight", torch.ones(128))], 1)[0][0]
        st, text = _raw(srv.url, "/update_weights_from_tensor", {**body, "weight_version": "3"})
        assert json.loads(text)["message"] == "Success Weight version updated to 3."
    finally:
        srv.stop_thread()


def test_shm_manager_started_away_from_the_clients_stderr():
    code = (
        "import os, torch\n"
        "from megatron_gspo.rollout.weight_sync_payloads import serialize\n"
        "serialize({'t': torch.ones(4)})\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        cmd = open(f'/proc/{pid}/cmdline', 'rb').read()\n"
        "    except OSError:\n"
        "        continue\n"
        "    if b'torch_shm_manager' in cmd and open(f'/proc/{pid}/stat').read().split()[3]"
        " == str(os.getpid()):\n"
        "        print(os.readlink(f'/proc/{pid}/fd/2'), os.readlink('/proc/self/fd/2'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 0, out.stderr[-2000:]
    manager, mine = out.stdout.split()
    assert mine.startswith("pipe:") and manager == "/dev/null", (manager, mine)


def test_control_call_after_a_long_blocked_loop(standin):
    """SGLang (uvicorn) closes idle keep-alive connections after 5 s, as the stand-in now does;
    a call made after the client's event loop was busy longer (serializing a payload) must not
    go out on the closed connection."""
    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01)

    async def go():
        await eng._post(standin.url, "/flush_cache")
        time.sleep(6)  # the loop is blocked: the server's close is not seen
        return await eng._post(standin.url, "/flush_cache")

    try:
        assert eng.sync(go()).startswith("Cache flushed.")
    finally:
        eng.shutdown()
