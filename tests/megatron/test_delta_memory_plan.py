"""The memory plan with `rollout.weight_sync_delta`: rank 0's base (a copy of the served
weights, or a digest per tensor), the loader's copy in every SGLang TP rank's host memory, and
the servers' weights kept on the GPU while the learner trains (a release would force a full
sync every step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_gspo.megatron.memory import plan as mp
from megatron_gspo.megatron.memory import report as mr

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "examples" / "qwen3_gpu"


def _plan(config: str, shape: str, *overrides: str):
    from megatron_gspo.config import load_config

    cfg = load_config(GPU / config, list(overrides))
    hf = json.loads((GPU / "shapes" / shape / "config.json").read_text())
    x = mr.inputs_from_config(cfg, hf, gpu_bytes=80 * 10**9, gpus_per_node=8)
    return x, mr.build_plan(x)


@pytest.mark.parametrize("config,shape,fits", [
    ("qwen3_8b_1node.yaml", "Qwen3-8B", True),
    # colocated on one node the servers' kept weights do not fit beside the optimizer step
    ("qwen3_30b_a3b_1node.yaml", "Qwen3-30B-A3B", False)])
def test_delta_sync_costs_in_the_plan(config, shape, fits):
    x0, off = _plan(config, shape)
    x, on = _plan(config, shape, "rollout.weight_sync_delta=auto")
    params = mr._total_params(x)
    assert off.delta_host_bytes == 0 and "delta-sync base" not in mr.format_plan(off, x0)
    assert on.delta_host_bytes == on.delta_server_bytes == params * 2  # bf16 copies
    text = mr.format_plan(on, x)
    assert "delta-sync base" in text and "delta loader copy" in text
    trains = ("training", "forward/backward", "optimizer step")
    before = {n: b for n, b, _ in off.moments if n in trains}
    after = {n: b for n, b, _ in on.moments if n in trains}
    assert before and after == {n: b + on.term("SGLang weights") for n, b in before.items()}
    assert on.fits == fits, on.problems
    assert fits or on.problems[0].startswith("optimizer step")
    _, hashed = _plan(config, shape, "rollout.weight_sync_delta=on",
                      "rollout.weight_sync_delta_base=hash")
    assert 0 < hashed.delta_host_bytes < mp.GiB // 1000 and hashed.delta_server_bytes == 0


def test_deltas_keep_the_servers_weights():
    from megatron_gspo.config import load_config
    from megatron_gspo.loop.weight_sync_phase import released_after_rollout

    cfg = load_config(GPU / "qwen3_8b_1node.yaml", [])
    assert released_after_rollout(cfg) is None
    cfg = load_config(GPU / "qwen3_8b_1node.yaml", ["rollout.weight_sync_delta=auto"])
    assert released_after_rollout(cfg) == ("kv_cache", "cuda_graph")
