"""SGLang version differences (megatron_gspo/rollout/sglang/versions.py), against the stand-in
acting as each supported release: a CPU-engine server of SGLang 0.5.23 ends on
/release_memory_occupation (weight_updater.py:379 under torch 2.14.1), so the client sends
memory calls to no CPU-engine server and keeps its released-region bookkeeping; GPU servers
still get them. The real servers' side is tests/rollout/test_sglang_real_multinode.py."""

from __future__ import annotations

import aiohttp
import pytest

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from megatron_gspo.rollout.sglang import versions as compat
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.standin.server import StandinServer
from tests.rollout.test_sglang_real_findings import _post


def _standin(engine, model_dir, **kw) -> StandinServer:
    return StandinServer(engine, model_path=model_dir, **kw).start_in_thread()


def test_a_0523_cpu_server_ends_on_memory_release(engine, tiny_model_dir):
    srv = _standin(engine, tiny_model_dir, device="cpu", weight_update_sessions=True)
    try:
        with pytest.raises(aiohttp.ClientError):
            _post(srv.url, "/release_memory_occupation", {"tags": None})
        assert "weight_updater.py:379" in srv.died
    finally:
        srv.stop_thread()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_memory_calls_reach_no_cpu_engine(engine, tiny_model_dir, device):
    srv = _standin(engine, tiny_model_dir, device=device, weight_update_sessions=True)
    eng = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    try:
        eng.release_memory(["kv_cache", "cuda_graph"])
        assert eng.released_tags == {"kv_cache", "cuda_graph"}
        eng.resume_memory()
        assert not eng.released_tags and getattr(srv, "died", None) is None
        sent = [(m.split()[0], set(m.split()[1].split(","))) for m in srv.memory_log]
        assert sent == ([] if device == "cpu" else [("release", {"kv_cache", "cuda_graph"}),
                                                     ("resume", {"kv_cache", "cuda_graph"})])
        with pytest.raises(RolloutError, match="not released"):  # refused as before
            eng.sync(eng.aresume_memory(["weights"]))
        [s] = eng.generate([GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=4,
                                                                      ignore_eos=True))])
        assert len(s.response_ids) == 4
    finally:
        eng.shutdown()
        srv.stop_thread()


def test_sends_memory_calls():
    assert not compat.sends_memory_calls({"device": "cpu"})
    assert compat.sends_memory_calls({"device": "cuda"}) and compat.sends_memory_calls({})


def test_lacks_update_sessions():
    assert compat.lacks_update_sessions(RolloutError(
        "http://h:1/begin_weight_update answered HTTP 404: {'detail': 'Not Found'}"))
    assert not compat.lacks_update_sessions(RolloutError(
        "http://h:1/begin_weight_update answered HTTP 400: already open"))


@pytest.mark.parametrize("version, warned", [
    ("0.5.12", False), ("0.5.23", False), ("0.5.17rc1", False), ("standin", False),
    ("0.5.11", True), ("0.5.24", True), ("0.6.0", True), ("", False)])
def test_version_warning(version, warned):
    note = compat.version_warning({"version": version})
    assert (note is not None) == warned
    if warned:
        assert note.startswith(f"SGLang {version} is outside the tested range 0.5.12 to 0.5.23")
