"""FP8 weights on each SGLang weight path against a stand-in server that serves a block-FP8
checkpoint (`convert hf-to-fp8`'s writer), as SGLang's fp8 method holds one (weights and their
`weight_scale_inv` are parameters): the learner side's quantized stream (quant/fp8_stream.py)
through update_weights_from_tensor (flattened: the FP8 weights and the float32 scales travel in
separate requests) and update_weights_from_distributed (gloo), after which the server computes
with exactly the dequantized new weights."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_gspo.quant.blockfp8 import dequantize, quantize
from megatron_gspo.quant.fp8_checkpoint import write_fp8_checkpoint
from megatron_gspo.quant.fp8_stream import quantize_buckets
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.standin.server import StandinServer
from tests.megatron._dist import free_port




def _expected(new, kept):
    return [(n, t if n.removesuffix(".weight") in kept or t.dim() != 2
             else dequantize(*quantize(t), torch.float32)) for n, t in new]


def test_fp8_weights_reach_the_served_model_dequantized(tiny_model_dir, tmp_path):
    path = "tensor"
    fp8_dir = tmp_path / "fp8"
    qc = write_fp8_checkpoint(tiny_model_dir, fp8_dir)
    kept = set(qc["modules_to_not_convert"])
    server_engine = EmbeddedEngine(str(fp8_dir), seed=3)
    srv = StandinServer(server_engine, model_path=str(fp8_dir)).start_in_thread()
    kw = ({"weight_sync": "distributed", "dist_master": ("127.0.0.1", free_port(55535)),
           "dist_backend": "gloo"} if path == "distributed" else {"weight_sync": "tensor"})
    eng = SGLangEngine(server_urls=[srv.url], backoff_s=0.01, **kw)
    learner = EmbeddedEngine(tiny_model_dir)
    new = [(n, p.detach() + 0.01 * torch.randn_like(p)) for n, p in
           learner.model.named_parameters()]
    try:
        stats: dict = {}
        eng.update_weights(quantize_buckets([new], kept, stats), version=1)
        assert stats["fp8_tensors"] > 0 and srv.weight_version == "1"
        served = dict(server_engine.model.named_parameters())
        for n, t in _expected(new, kept):
            assert torch.equal(served[n], t), n
        assert srv.fp8_rx.unpaired() == []
    finally:
        eng.shutdown()
        srv.stop_thread()


def test_gloo_cannot_broadcast_fp8_so_the_cpu_distributed_path_is_refused(tiny_model_dir,
                                                                          tmp_path):
    """update_weights_from_distributed over gloo (the CPU servers' backend), the server in its
    own process: gloo has no float8 type, so the server answers "Invalid scalar type" and keeps
    its weights; a run with that combination is refused at start in one line. (NCCL, the GPU
    path, carries float8 as bytes: not checked here.)"""
    from megatron_gspo.config import ConfigError, load_config
    from megatron_gspo.loop.server_setup import sglang_engine
    from megatron_gspo.rollout.engine import RolloutError, SamplingParams

    import subprocess
    import sys
    import time
    import urllib.request

    from megatron_gspo.rollout.standin.weight_sync_server import weights_digest

    fp8_dir = tmp_path / "fp8"
    kept = set(write_fp8_checkpoint(tiny_model_dir, fp8_dir)["modules_to_not_convert"])
    port = free_port(55535)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_gspo.rollout.standin.server",
                             "--model-path", str(fp8_dir), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    eng = None
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                time.sleep(0.5)
        eng = SGLangEngine(server_urls=[url], backoff_s=0.01, weight_sync="distributed",
                           dist_master=("127.0.0.1", free_port(55535)), dist_backend="gloo")
        learner = EmbeddedEngine(tiny_model_dir)
        new = [(n, p.detach() + 0.01 * torch.randn_like(p)) for n, p in
               learner.model.named_parameters()]
        with pytest.raises((RolloutError, RuntimeError), match="Invalid scalar type"):
            eng.update_weights(quantize_buckets([new], kept), version=1)
        got = json.loads(urllib.request.urlopen(url + "/standin/weights_digest").read())
        assert got["digest"] != weights_digest(_expected(new, kept))
        cfg = load_config(None, ["rollout.engine=sglang", f"model.path={tiny_model_dir}",
                                 "rollout.weight_precision=fp8", "rollout.colocate=false",
                                 "rollout.weight_sync=distributed", "rollout.sglang_device=cpu",
                                 f"rollout.server_urls=[{url}]"])
        with pytest.raises(ConfigError, match="gloo .* cannot broadcast float8_e4m3fn"):
            sglang_engine(cfg, SamplingParams())
    finally:
        if eng is not None:
            eng.shutdown()
        proc.terminate()
        proc.wait(30)
