"""FP8 rollouts (`rollout.weight_precision: fp8`; loop/fp8_rollout.py, quant/fp8_stream.py): the
sync stream carries each FP8 module's weight as block FP8 plus its scale, under the served
checkpoint's names; W8A16 engines dequantize them (pairs may arrive in separate requests); tiny
runs with the embedded engine and with a launched stand-in server that starts from the run's
FP8 copy pass the sync probe at every version; a BF16 server given FP8 bytes fails it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.quant.blockfp8 import FP8_DTYPE, dequantize, quantize
from megatron_gspo.quant.fp8_stream import Fp8Receiver, dequantize_named, quantize_buckets

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "_fp8_worker.py"


def _bucket():
    g = torch.Generator().manual_seed(0)
    return [("model.layers.0.mlp.down_proj.weight", torch.randn(128, 256, generator=g)),
            ("model.layers.0.self_attn.k_proj.weight", torch.randn(64, 128, generator=g)),
            ("model.norm.weight", torch.ones(128)),
            ("lm_head.weight", torch.randn(100, 128, generator=g))]


def test_stream_quantizes_what_the_checkpoint_holds_in_fp8_and_engines_dequantize():
    kept = {"model.layers.0.self_attn.k_proj", "lm_head"}
    stats: dict = {}
    (out,) = list(quantize_buckets([_bucket()], kept, stats))
    names = [n for n, _ in out]
    assert names == ["model.layers.0.mlp.down_proj.weight",
                     "model.layers.0.mlp.down_proj.weight_scale_inv",
                     "model.layers.0.self_attn.k_proj.weight", "model.norm.weight",
                     "lm_head.weight"]
    assert out[0][1].dtype == FP8_DTYPE and out[1][1].dtype == torch.float32
    assert tuple(out[1][1].shape) == (1, 2) and stats["fp8_tensors"] == 1
    assert stats["fp8_bytes_saved"] == 128 * 256 * 4 - 128 * 256 - 2 * 4
    q, s = quantize(_bucket()[0][1])
    assert torch.equal(out[0][1].view(torch.uint8), q.view(torch.uint8))
    back = dict(dequantize_named(out, torch.float32))
    assert set(back) == {n for n, _ in _bucket()}
    assert torch.equal(back["model.layers.0.mlp.down_proj.weight"], dequantize(q, s, torch.float32))
    assert torch.equal(back["lm_head.weight"], _bucket()[3][1])


def test_receiver_pairs_halves_from_separate_requests_and_names_a_lone_half():
    """SGLang's flattened buckets are one request per dtype: the FP8 weights, then the scales."""
    (out,) = list(quantize_buckets([_bucket()], {"lm_head"}))
    rx = Fp8Receiver(torch.float32)
    fp8 = [(n, t) for n, t in out if t.dtype == FP8_DTYPE]
    rest = [(n, t) for n, t in out if t.dtype != FP8_DTYPE]
    first = rx.take(fp8)
    assert first == []  # both FP8 weights wait for their scales
    second = dict(rx.take(rest))
    assert set(second) == {n for n, _ in _bucket()} and rx.unpaired() == []
    rx.take(fp8[:1])
    assert rx.unpaired() == ["model.layers.0.mlp.down_proj.weight (no "
                             "model.layers.0.mlp.down_proj.weight_scale_inv)"]
    with pytest.raises(ValueError, match="k_proj.weight_scale_inv .no model.layers.0.self_attn"):
        dequantize_named([(n, t) for n, t in out if n.endswith("k_proj.weight_scale_inv")],
                         torch.float32)


def _run(tmp_path, mode, overrides=(), env=None):
    e = {**os.environ, **(env or {})}
    out = subprocess.run([sys.executable, str(WORKER), str(tmp_path), mode,
                          json.dumps(list(overrides))], cwd=ROOT, env=e, capture_output=True,
                         text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, (out.returncode, out.stderr[-3000:])
    return json.loads(line[len("RESULT "):])


def _sync(rows):
    return [{k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("weight_sync/")}
            for r in rows]


def test_embedded_engine_trains_with_fp8_weights(tmp_path):
    got = _run(tmp_path, "embedded")
    assert got["error"] is None, got["error"]
    assert len(got["rows"]) == 3
    # the tiny model: o_proj, gate/up (384 rows) and down_proj of the 4 layers travel as FP8
    # (q/k/v stay: k and v have 64 rows, not whole 128-row blocks for SGLang's fused qkv_proj)
    assert all(s.get("fp8_tensors") == 16 for s in _sync(got["rows"]))


@pytest.mark.parametrize("delta", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_launched_server_starts_from_the_fp8_copy_and_every_sync_is_verified(tmp_path, delta):
    """Tensor sync, full or as deltas (the FP8 bytes XOR-encoded by the delta loader)."""
    got = _run(tmp_path, "launched", ["rollout.num_servers=1", "rollout.startup_timeout=240"] + (
        ["rollout.weight_sync_delta=on"] if delta else []),
               env={"SGLANG_SERVER_MODULE": "megatron_gspo.rollout.standin.server"})
    assert got["error"] is None, got["error"]
    assert {"config.json", "model.safetensors", "fp8_source.json"} <= set(got["served"])
    sync = _sync(got["rows"])
    assert len(sync) == 3 and all(s["fp8_tensors"] == 16 for s in sync)
    assert all(0 < s["probe_max_diff"] < 1.0 for s in sync), sync
    if delta:  # measured: 26-32 % of the bytes changed a step, about half the bytes sent
        assert all(s["delta"] == 1.0 and s["delta_bytes_sent"] < s["delta_bytes_full"]
                   for s in sync[1:]), sync


def test_an_attached_bf16_server_is_refused_in_one_line(tmp_path):
    """Sent FP8 weights and scales, it would end (its Qwen3 loader looks the fused scale name
    up unchecked) or cast the FP8 bytes unscaled."""
    got = _run(tmp_path, "bf16_server")
    assert got["error"] is not None and got["error"].startswith(
        "ConfigError: rollout.weight_precision: fp8, but the server at http://127.0.0.1:"), got
    assert "holds no block-FP8 weights" in got["error"] and got["rows"] == []


def test_blackwell_servers_run_without_deepgemm_hopper_as_they_are():
    from megatron_gspo.loop.fp8_rollout import server_env

    assert server_env((10, 0)) == {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}
    assert server_env((9, 0)) == {} and server_env((8, 9)) == {}
