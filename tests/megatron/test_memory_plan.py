"""The memory plan's arithmetic (no learner): Megatron's buffer padding, SGLang 0.5.12's KV
sizing, the fit verdict with the changes that fit, the trainer's start-up check and the
`megatron-gspo plan` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_gspo.megatron.memory import changes as mc
from megatron_gspo.megatron.memory import plan as mp
from megatron_gspo.megatron.memory import report as mr

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "examples" / "qwen3_gpu" / "shapes"
GPU = ROOT / "examples" / "qwen3_gpu"


def _hf(name: str) -> dict:
    return json.loads((SHAPES / name / "config.json").read_text())


def test_parameter_counts_of_the_shipped_shapes():
    total = {n: mp.learner_bytes(mp.dims_from_hf(_hf(n)), param_bytes=4,
                                 vocab_multiple=1).weights // 4
             for n in ("Qwen3-8B", "Qwen3-30B-A3B", "Qwen3-1.7B")}
    assert round(total["Qwen3-8B"] / 1e9, 2) == 8.19
    assert round(total["Qwen3-30B-A3B"] / 1e9, 2) == 30.53
    assert round(total["Qwen3-1.7B"] / 1e9, 2) == 1.72


def test_distributed_buffer_padding_and_shards():
    # starts padded to 64, bucket end to lcm(dp, 128); shards cover every element once
    numel, spans, buckets = mp.buffer_ranges([10, 100, 3], [False] * 3, dp=3, distributed=True)
    assert spans == [(192, 202), (64, 164), (0, 3)] and numel == 384 and buckets == [(0, 384)]
    assert sum(mp.shard_elements(spans, buckets, 3, r) for r in range(3)) == 113
    # a shared embedding gets its own bucket
    numel, _, buckets = mp.buffer_ranges([10, 5], [True, False], dp=2, distributed=True)
    assert buckets == [(0, 128), (128, 256)] and numel == 256
    assert mp.buffer_ranges([10, 5], [True, False], 2, False)[0] == 15


def test_sglang_kv_tokens_follow_profile_max_num_token():
    d = mp.dims_from_hf(_hf("Qwen3-8B"))
    cell = mp.kv_cell_bytes(d, tp=1)
    assert cell == 8 * 2 * 128 * 36 * 2  # kv heads x (k + v) x head dim x layers x bf16
    assert mp.kv_cell_bytes(d, tp=16) == 1 * 2 * 128 * 36 * 2  # max(1, 8 // 16)
    free, weights = 60 * mp.GiB, 16 * mp.GiB
    # rest = (free - weights) - free * (1 - f) = free * f - weights
    assert mp.sglang_kv_tokens(free, weights, 0.5, cell) == (30 - 16) * mp.GiB // cell
    assert mp.sglang_kv_tokens(free, weights, 0.2, cell) == 0
    f = mp.mem_fraction_for(free, weights, 100_000, cell)
    assert mp.sglang_kv_tokens(free, weights, f, cell) in (99_999, 100_000)


def _cfg(path: Path, overrides=()):
    from megatron_gspo.config import load_config

    return load_config(path, list(overrides))


def test_shipped_default_layout_does_not_fit_and_names_the_fix(tmp_path):
    cfg = _cfg(GPU / "qwen3_8b_1node.yaml", ["optimizer.distributed_optimizer=false",
                                              "rollout.offload_learner=false"])
    x = mr.inputs_from_config(cfg, _hf("Qwen3-8B"), gpu_bytes=80 * mp.GiB, gpus_per_node=8)
    plan = mr.build_plan(x)
    assert not plan.fits
    assert "optimizer moments" in plan.problems[0]
    assert plan.term("gradient buffer") == 2 * plan.term("learner weights")  # fp32 grads
    assert mc.fitting_changes(x)[0] == "optimizer.distributed_optimizer=true"


@pytest.mark.parametrize("config,shape,nodes", [
    ("qwen3_8b_1node.yaml", "Qwen3-8B", 1), ("qwen3_30b_a3b_1node.yaml", "Qwen3-30B-A3B", 1),
    ("qwen3_30b_a3b_2nodes.yaml", "Qwen3-30B-A3B", 2)])
def test_shipped_gpu_configs_fit_80gb(config, shape, nodes):
    cfg = _cfg(GPU / config)
    x = mr.inputs_from_config(cfg, _hf(shape), gpu_bytes=80 * 10**9, gpus_per_node=8,
                              nodes=nodes)
    plan = mr.build_plan(x)
    assert plan.fits, plan.problems
    assert plan.kv_tokens >= 100_000  # room for many responses per server


def test_the_changes_named_are_the_ones_checked_to_fit():
    """The layout the launch scripts used to force on the 2-node 30B config (TP-1 servers,
    mem_fraction 0.5): no setting of the learner helps; a larger rollout TP does, and every
    change named rebuilds into a plan that fits. Another shape needs more nodes or recompute
    and micro-batch changes, which are named too."""
    import dataclasses

    cfg = _cfg(GPU / "qwen3_30b_a3b_2nodes.yaml", ["rollout.tp_size=1", "rollout.num_servers=8",
                                                    "rollout.mem_fraction=0.5"])
    x = mr.inputs_from_config(cfg, _hf("Qwen3-30B-A3B"), gpu_bytes=80 * 10**9, gpus_per_node=8,
                              nodes=2)
    plan = mr.build_plan(x)
    assert not plan.fits and plan.problems[0].startswith("checkpoint: 89.4 GiB")
    changes = mc.fitting_changes(x)
    assert changes == ["rollout.tp_size=2 rollout.num_servers=4",
                       "rollout.tp_size=4 rollout.num_servers=2",
                       "rollout.tp_size=8 rollout.num_servers=1"]
    line = mc.describe_changes(changes)
    assert line.startswith("changes checked that fit: rollout.tp_size=2")
    for tp in (2, 4, 8):
        assert mr.build_plan(dataclasses.replace(x, server_tp=tp)).fits
    # activations: recompute or a smaller micro-batch
    cfg = _cfg(GPU / "qwen3_8b_1node.yaml", ["model.recompute_activations=false",
                                              "algorithm.micro_batch_tokens=32768"])
    x = mr.inputs_from_config(cfg, _hf("Qwen3-8B"), gpu_bytes=80 * 10**9, gpus_per_node=8)
    assert not mr.build_plan(x).fits
    assert mc.fitting_changes(x) == ["model.recompute_activations=true",
                                     "algorithm.micro_batch_tokens=8192"]
    # optimizer state on one node: offloading it, learner TP, or more nodes (DP shards it)
    cfg = _cfg(GPU / "qwen3_30b_a3b_1node.yaml", ["optimizer.offload_outside_step=false"])
    x = mr.inputs_from_config(cfg, _hf("Qwen3-30B-A3B"), gpu_bytes=80 * 10**9,
                              gpus_per_node=8)
    assert mc.fitting_changes(x) == ["optimizer.offload_outside_step=true",
                                     "parallel.tensor=4 parallel.sequence_parallel=true",
                                     "NNODES=2 (--nodes 2)", "NNODES=4 (--nodes 4)"]
    assert mr.build_plan(dataclasses.replace(x, world=16)).fits


def test_start_up_check_refuses_with_the_biggest_term():
    from megatron_gspo.config import ConfigError
    from megatron_gspo.loop.early_checks import check_memory

    cfg = _cfg(GPU / "qwen3_30b_a3b_1node.yaml", ["rollout.offload_learner=false"])
    with pytest.raises(ConfigError, match=r"memory plan: .*biggest term: .*GiB.*changes "
                       r"checked that fit: ") as e:
        check_memory(cfg, _hf("Qwen3-30B-A3B"), world=8, gpu_bytes=80 * 10**9)
    assert "\n" not in str(e.value)
    check_memory(cfg, _hf("Qwen3-30B-A3B"), world=8)  # no GPU here: skipped
    cfg = _cfg(GPU / "qwen3_30b_a3b_1node.yaml")
    check_memory(cfg, _hf("Qwen3-30B-A3B"), world=8, gpu_bytes=80 * 10**9)


def test_plan_command(capsys):
    from megatron_gspo.cli import main

    shape = str(SHAPES / "Qwen3-8B")
    assert main(["plan", str(GPU / "qwen3_8b_1node.yaml"), "--model-config", shape]) == 0
    out = capsys.readouterr().out
    for row in ("learner weights", "gradient buffer", "main weights", "optimizer moments",
                "KL reference", "activations", "logits / log-probs", "SGLang KV cache",
                "SGLang CUDA graphs", "training", "generation", "weight sync", "fits"):
        assert row in out
    assert main(["plan", str(GPU / "qwen3_8b_1node.yaml"), "--model-config", shape,
                 "--gpu-memory", "24GiB"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert main(["plan", str(GPU / "qwen3_8b_1node.yaml"), "--model-config", shape,
                 "--gpu-memory", "lots"]) == 2


def test_parse_bytes():
    assert mr.parse_bytes("80GiB") == 80 * 2**30 == mr.parse_bytes("80G")
    assert mr.parse_bytes("80GB") == 80 * 10**9
    with pytest.raises(ValueError):
        mr.parse_bytes("eighty")


def test_fp8_servers_halve_their_projections_and_free_kv(capsys):
    """rollout.weight_precision=fp8 on qwen3_8b_1node (80 GB GPUs): the servers' weights drop
    from 15.26 to 8.79 GiB (embeddings and lm_head stay BF16), the KV cache grows from 279,423
    to 326,517 tokens, and the weight sync holds the quantizer's buffer of the largest
    projection; the BF16 plan is unchanged."""
    from megatron_gspo.cli import main

    args = ["plan", str(GPU / "qwen3_8b_1node.yaml"), "--model-config", str(SHAPES / "Qwen3-8B"),
            "--gpu-memory", "80GB"]
    assert main(args) == 0
    bf16 = capsys.readouterr().out
    assert main([*args, "rollout.weight_precision=fp8"]) == 0
    fp8 = capsys.readouterr().out
    assert "SGLang weights            15.26 GiB  bf16, server TP1" in bf16
    assert "279423 tokens" in bf16 and "FP8" not in bf16
    assert "SGLang weights             8.79 GiB  fp8 projections" in fp8
    assert "326517 tokens" in fp8 and "FP8 quantize buffer" in fp8
    sync = lambda out: float(next(ln for ln in out.splitlines()  # noqa: E731
                                  if ln.strip().startswith("weight sync")).split()[2])
    assert sync(fp8) < sync(bf16)
