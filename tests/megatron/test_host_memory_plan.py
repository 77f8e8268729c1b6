"""The plan's pinned host memory: the offloaded learner plus the staging copy every checkpoint
leaves in torch's pinned host cache (Megatron-Core's `preload_tensors`, `memory.staging`), per
rank and per node. tests/megatron/test_mg_memory.py checks the staged tensors against a real
save, rank by rank."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_gspo.megatron.memory import plan as mp
from megatron_gspo.megatron.memory import report as mr

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "examples" / "qwen3_gpu"


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_one_rank_stages_every_weight_and_its_adam_state_in_power_of_two_blocks():
    """One GPU, bf16, no distributed optimizer, learner not offloaded: today's plan shows no
    host memory at all, but the first checkpoint leaves a pinned copy of every weight (bf16)
    and of its fp32 main weight and two moments in torch's host cache."""
    h, hd, nh, kv, f, layers = 48, 16, 3, 1, 96, 2
    d = mp.Dims(hidden=h, layers=layers, heads=nh, kv_heads=kv, head_dim=hd, ffn=f, vocab=200)
    x = mr.PlanInputs(dims=d, gpu_bytes=80 * mp.GiB, world=1, gpus_per_node=1)
    emb = 256 * h  # vocabulary padded to 128
    numels = [emb] + [h, h * nh * hd, (nh + 2 * kv) * hd * h, hd, hd, h,
                      f * h, f * h,  # fc1: gate and up halves (the SwiGLU factory)
                      f * h] * layers + [h, emb]
    want = sum(_pow2(2 * n) + 3 * _pow2(4 * n) for n in numels)
    plan = mr.build_plan(x)
    assert plan.host_bytes == want  # today: 0 (the row counted only an offloaded learner)
    assert plan.staging_bytes == want and plan.node_host_bytes == want
    text = mr.format_plan(plan, x)
    assert "checkpoint staging" in text and "pinned host, one node" in text
    assert "offloaded learner" not in text  # nothing offloaded


def test_only_dp_rank_0_writes_weights_and_the_distributed_optimizer_splits_the_state():
    from megatron_gspo.megatron.memory import staging

    d = mp.dims_from_hf(json.loads((GPU / "shapes" / "Qwen3-1.7B" / "config.json").read_text()))
    rep = mr.PlanInputs(dims=d, gpu_bytes=80 * mp.GiB, world=4, gpus_per_node=4)
    per_rank = [staging.staging_bytes(rep, r) for r in range(4)]
    assert per_rank[0] > 0 and per_rank[1:] == [0, 0, 0]  # DP replicas: rank 0 writes
    dist = mr.PlanInputs(dims=d, gpu_bytes=80 * mp.GiB, world=4, gpus_per_node=2,
                         distributed_optimizer=True)
    per_rank = [staging.staging_bytes(dist, r) for r in range(4)]
    assert all(b > 0 for b in per_rank) and per_rank[0] > max(per_rank[1:])  # + the weights
    # the ranks' optimizer tensors together: main weight, exp_avg, exp_avg_sq (fp32) of
    # every element of the buffer, its alignment padding included, the end padding not
    params = mp.learner_bytes(d, param_bytes=1).weights  # elements
    padded = mp.learner_bytes(d, dp=4, distributed=True).grads // 4
    staged = sum(sum(staging.staged_tensor_bytes(dist, r)) for r in range(4))
    assert params <= (staged - 2 * params) // 12 <= padded
    plan = mr.build_plan(dist)
    assert plan.staging_bytes == per_rank[0]
    assert plan.node_host_bytes == max(per_rank[0] + per_rank[1], per_rank[2] + per_rank[3])


def test_shipped_8b_config_host_row_adds_the_staging_copy_to_the_offloaded_learner():
    from megatron_gspo.config import load_config
    from megatron_gspo.megatron.memory import staging

    cfg = load_config(GPU / "qwen3_8b_1node.yaml", [])
    hf = json.loads((GPU / "shapes" / "Qwen3-8B" / "config.json").read_text())
    x = mr.inputs_from_config(cfg, hf, gpu_bytes=80 * 10**9, gpus_per_node=8)
    plan = mr.build_plan(x)
    offloaded = mr.pinned_host_bytes(x)
    assert offloaded > 0 and plan.host_bytes == offloaded + staging.staging_bytes(x, 0)
    assert staging.staging_bytes(x, 0) > offloaded // 2  # TP2 weights + a quarter of state
    assert plan.node_host_bytes == 8 * offloaded + sum(
        staging.staging_bytes(x, r) for r in range(8))
    assert plan.fits  # host memory does not decide the GPU verdict
