"""Where a delta weight sync's payloads go (issue 53, defects 4 and 5): with colocated servers
each server's delta payload is serialized by the learner rank on that server's GPU (the
entry-rank plan of the full sync), one process never hands GPU tensors to every server (the
refusal attached servers get), and tensors SGLang fuses on load (DeepSeek's two attention
down-projections) reach the server together even when only one of them changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.rollout.engine import RolloutError
from megatron_gspo.rollout.delta.sender import DeltaSender
from megatron_gspo.rollout.sglang import weight_sync_delta as delta_sync
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.standin.server import StandinServer

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_delta_ipc_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stream", "loop"])
def test_delta_payload_of_server_i_comes_from_the_learner_rank_on_its_gpu(tmp_path, mode):
    """"loop": the RL loop's weight-sync phase with colocated servers and deltas on takes the
    full sync's placement (it sent every server rank 0's one serialization, issue 53 defect 4)."""
    from megatron_gspo.megatron.parallel import free_port

    port, loader = free_port(), delta_sync.loader_dir(str(tmp_path / "loader"))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(port), loader, mode],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    r0 = json.loads(next(x for x in outs[0][0].splitlines() if x.startswith("RESULT "))[7:])
    assert r0["delta"] and r0["equal"] == [True, True] and r0["versions"] == ["2", "2"]
    for i, received in enumerate(r0["received"]):
        deltas = [o for fmt, o in received if fmt == delta_sync.LOADER]
        assert deltas and len(deltas) == len(received), received
        # every tensor of server i's entries lives in learner rank i's memory (on GPUs: a
        # CUDA IPC handle to GPU i, never one to rank 0's GPU)
        assert {x for o in deltas for rank_o in o for x in rank_o} == {f"pid:{r0['pids'][i]}"}


def test_a_delta_bucket_on_a_gpu_is_refused_from_one_process(engine, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(delta_sync.loader_dir(str(tmp_path / "loader")))
    srv = StandinServer(engine, model_path="tiny",
                        custom_weight_loaders=[delta_sync.LOADER]).start_in_thread()
    client = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)  # attached by URL
    client.delta = DeltaSender("on")
    try:  # "meta" stands for "cuda" here, as a CUDA export would place the tensors
        bucket = [(k, torch.empty(v.shape, dtype=v.dtype, device="meta"))
                  for k, v in engine.model.named_parameters()]
        with pytest.raises(RolloutError, match="a delta bucket on meta cannot go to every "
                           "server from one process.*rollout.weight_sync=distributed"):
            client.update_weights([bucket], 1)
        assert srv.stats["weight_updates"] == 0 and not srv.received
        assert client.delta.acked_version is None  # the next sync is full
    finally:
        client.shutdown()
        srv.stop_thread()


def test_deepseek_down_projections_reach_the_server_in_one_delta_sync(tmp_path, monkeypatch):
    """The RL loop's delta sync of a DeepSeek-V3: one changed attention down-projection goes
    with its unchanged partner (SGLang fuses the two per load_weights call and drops a lone
    one without a word; issue 53 defect 5)."""
    from megatron_gspo.megatron.io.weight_export import bucket_together, bucketize
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from tests.convert.tiny_families import DEEPSEEK_V3, make_family_model

    monkeypatch.syspath_prepend(delta_sync.loader_dir(str(tmp_path / "loader")))
    make_family_model("DeepseekV3ForCausalLM", tmp_path / "m", seed=1)
    served = EmbeddedEngine(str(tmp_path / "m"))
    q_a, kv_a = (f"model.layers.0.self_attn.{p}.weight" for p in ("q_a_proj", "kv_a_proj_with_mqa"))
    params = dict(served.model.named_parameters())
    # the stand-in drops a lone down-projection, as SGLang's DeepSeek loader does
    before = params[q_a].detach().clone()
    srv = StandinServer(served, model_path=str(tmp_path / "m"),
                        custom_weight_loaders=[delta_sync.LOADER]).start_in_thread()
    srv.served_model.load_weights([(q_a, before + 1)])
    assert torch.equal(params[q_a], before)
    client = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    w = {k: v.detach().clone() + 1e-3 for k, v in params.items()}
    bound = w[q_a].numel() * 4  # a bound that would put q_a_proj and kv_a_proj_with_mqa apart
    sync_phase = _sync_phase(monkeypatch, lambda: bucketize(
        iter(sorted(w.items())), bound, together=bucket_together(DEEPSEEK_V3)), [
        "rollout.colocate=false", f"rollout.server_urls=[{srv.url}]",
        "rollout.weight_sync_delta=on"])

    def sync(version):
        sync_phase(client, DEEPSEEK_V3, version)
        return all(torch.equal(params[k], v) for k, v in w.items())

    try:
        assert sync(1) and not client.delta.stats.delta  # full
        w[q_a] = w[q_a] * 1.01  # only one of the pair changed
        assert sync(2) and client.delta.stats.delta  # ONE delta sync: the server holds it
        assert client.delta.stats.kinds["same"] == len(w) - 2
    finally:
        client.shutdown()
        srv.stop_thread()


def _sync_phase(monkeypatch, buckets, overrides):
    """The RL loop's weight-sync phase (`loop.weight_sync_phase.sync_weights`) with the learner's
    export
    replaced by `buckets()`."""
    from types import SimpleNamespace

    from megatron_gspo.config import load_config
    from megatron_gspo.loop.weight_sync_phase import sync_weights
    from megatron_gspo.megatron.io import weight_export as export

    monkeypatch.setattr(export, "export_hf_weights", lambda *a, **k: buckets())
    # colocated: the learner stays (no offload); not colocated, nothing shares its GPUs
    stay = [] if "rollout.colocate=false" in overrides else ["rollout.offload_learner=false"]
    cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", [
        "rollout.engine=sglang", "rollout.weight_sync=tensor", *stay,
        "rollout.verify_sync_interval=0", *overrides])
    learner = SimpleNamespace(chunks=None, lora=None, offloaded_parts=lambda: [])
    return lambda engine, hf, version: sync_weights(learner, engine, hf, cfg, version)


@pytest.mark.parametrize("delta", ["on", "off"])
def test_servers_attached_on_gpus_are_refused_with_deltas_as_without(
        engine, tiny_model_dir, tmp_path, monkeypatch, delta):
    """Servers given by URL whose GPUs are unknown: the delta sync refuses them with the full
    sync's line (it posted rank 0's handles to every server, issue 53 defect 4)."""
    from megatron_gspo.rollout.multinode import colocated

    monkeypatch.syspath_prepend(delta_sync.loader_dir(str(tmp_path / "loader")))
    monkeypatch.setattr(colocated, "local_gpu", lambda: 0)  # the learner on GPU 0
    srv = StandinServer(engine, model_path="tiny",
                        custom_weight_loaders=[delta_sync.LOADER]).start_in_thread()
    client = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    hf = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    named = [(k, v.detach().clone()) for k, v in engine.model.named_parameters()]
    sync = _sync_phase(monkeypatch, lambda: iter([named]), [
        "rollout.colocate=false", f"rollout.server_urls=[{srv.url}]",
        f"rollout.weight_sync_delta={delta}"])
    try:
        with pytest.raises(RolloutError, match=r"^rollout.weight_sync=tensor with "
                           r"rollout.server_urls on GPUs: .* rollout.weight_sync=distributed$"):
            sync(client, hf, 1)
        assert srv.stats["weight_updates"] == 0 and not srv.received
    finally:
        client.shutdown()
        srv.stop_thread()
