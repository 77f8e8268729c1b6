"""Colocated runs of the tiny model on the stand-in SGLang server, each with the device-memory
ledger of the shipped GPU configs (examples/qwen3_gpu, 80 GB GPUs): the real calls of the loop
(offload, onload, empty_cache, release, resume, export buckets, checkpoint, sync probe, a
resume from the checkpoint) drive a model of one GPU sized from `megatron-gspo plan`, and every
moment must fit the GPU and match the plan's figure within 5%. The tiny run takes the shipped
config's memory switches (offload outside the optimizer step, KL reference, LoRA), so it makes
the calls that config makes.

The LoRA run: the servers keep their weights (only the KV cache and CUDA graphs are released),
so the partial syncs of the adapted layers land on whole weights; the sync probe verifies the
served log-probs against the learner's at every version."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "examples" / "qwen3_gpu"
WORKER = Path(__file__).with_name("_ledger_worker.py")
CONFIGS = {"qwen3_8b_1node": ("Qwen3-8B", 1), "qwen3_30b_a3b_1node": ("Qwen3-30B-A3B", 1),
           "qwen3_30b_a3b_2nodes": ("Qwen3-30B-A3B", 2)}
FRESH = {"start-up", "generation", "training", "weight sync", "checkpoint", "sync probe"}


def _spec(out: Path, config: str, overrides=()) -> Path:
    from megatron_gspo.cli import main

    shape, nodes = CONFIGS[config]
    assert main(["plan", str(GPU / f"{config}.yaml"), *overrides, "--model-config",
                 str(GPU / "shapes" / shape), "--gpu-memory", "80GB", "--nodes", str(nodes),
                 "--ledger-spec", str(out)]) == 0
    return out


def _switches(config: str) -> list[str]:
    """The shipped config's settings that change the memory calls of the loop."""
    from megatron_gspo.config import load_config

    cfg = load_config(GPU / f"{config}.yaml", [])
    out = [f"optimizer.offload_outside_step={str(cfg.optimizer.offload_outside_step).lower()}"]
    if cfg.rollout.offload_learner is not None:
        out.append(f"rollout.offload_learner={str(cfg.rollout.offload_learner).lower()}")
    if cfg.algorithm.kl_coef:
        out.append(f"algorithm.kl_coef={cfg.algorithm.kl_coef}")
    if cfg.model.lora.rank:
        out.append(f"model.lora.rank={cfg.model.lora.rank}")
    return out


def _run(work: Path, specs: list[Path], overrides: list[str]) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2",
               MEGATRON_GSPO_DEVICE_LEDGER=os.pathsep.join(map(str, specs)))
    out = subprocess.run([sys.executable, str(WORKER), str(work), json.dumps(overrides)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{config: {"fresh": report, "resume": report}}: one run (2 steps, then resumed to 3)
    per set of memory switches, with the ledgers of every config that has them."""
    groups: dict[tuple, list[str]] = {}
    for config in CONFIGS:
        groups.setdefault(tuple(_switches(config)), []).append(config)
    got: dict[str, dict] = {}
    for i, (switches, configs) in enumerate(groups.items()):
        work = tmp_path_factory.mktemp(f"ledger{i}")
        for phase, steps in (("fresh", 2), ("resume", 3)):
            specs = [_spec(work / f"{phase}-{c}.json", c) for c in configs]
            _run(work, specs, [f"train.max_steps={steps}", *switches])
            for c, s in zip(configs, specs, strict=True):
                got.setdefault(c, {})[phase] = json.loads(Path(f"{s}.report.json").read_text())
        shutil.rmtree(work / "run", ignore_errors=True)
    return got


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_moment_fits_the_gpu_and_the_plan(reports, config):
    for phase, first in (("fresh", "start-up"), ("resume", "resume")):
        rep = reports[config][phase]
        assert rep["problems"] == [], rep["problems"]
        rows = {r["moment"]: r for r in rep["moments"]}
        assert set(rows) == FRESH - {"start-up"} | {first}, (phase, sorted(rows))
        for name, r in rows.items():
            assert r["peak_bytes"] <= rep["gpu_bytes"], (phase, name)
            assert abs(r["off"]) <= 0.05, (phase, name, r)
        assert rep["kv_tokens"] == rep["plan_kv_tokens"]  # the cache was returned at launch


def test_colocated_lora_run_keeps_the_served_weights(tmp_path):
    spec = _spec(tmp_path / "lora.json", "qwen3_8b_1node", ["model.lora.rank=16"])
    res = _run(tmp_path, [spec], ["train.max_steps=3", "model.lora.rank=4", "optimizer.lr=1e-2"])
    rep = json.loads(Path(f"{spec}.report.json").read_text())
    assert rep["problems"] == [], rep["problems"]
    assert res["lost_weights"] == [] and res["weight_version"] == "3"
    assert "release kv_cache,weights,cuda_graph" not in res["memory_log"]
    rows = [json.loads(x) for x in (Path(res["run_dir"]) / "metrics.jsonl").read_text()
            .splitlines()]
    probes = [r["weight_sync/probe_max_diff"] for r in rows]
    assert len(probes) == 3 and max(probes) < 1e-5  # fp32: the learner's log-probs, served
