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
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_ledger.py"
sys.path.insert(0, str(SCRIPT.parent))
from device_ledger import CONFIGS, run_worker, write_spec  # noqa: E402 - scripts/device_ledger.py

FRESH = {"start-up", "generation", "training", "weight sync", "checkpoint", "sync probe"}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{config: {"fresh": report, "resume": report}} from `scripts/device_ledger.py --json`
    (one run of 2 steps, resumed to 3, per set of memory switches); its exit code says whether
    any ledger found a problem."""
    out = tmp_path_factory.mktemp("ledger") / "reports.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.exists(), run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert run.returncode == (1 if any(got[c][p]["problems"] for c in got for p in got[c])
                              else 0), run.stdout[-2000:]
    assert all(f"{c} (one GPU of 74.5 GiB" in run.stdout for c in CONFIGS)
    return got


@pytest.mark.slow
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
    spec = write_spec(tmp_path / "lora.json", "qwen3_8b_1node", ["model.lora.rank=16"])
    res = run_worker(tmp_path, [spec], ["train.max_steps=3", "model.lora.rank=4",
                                        "optimizer.lr=1e-2"])
    rep = json.loads(Path(f"{spec}.report.json").read_text())
    assert rep["problems"] == [], rep["problems"]
    assert res["lost_weights"] == [] and res["weight_version"] == "3"
    assert "release kv_cache,weights,cuda_graph" not in res["memory_log"]
    rows = [json.loads(x) for x in (Path(res["run_dir"]) / "metrics.jsonl").read_text()
            .splitlines()]
    probes = [r["weight_sync/probe_max_diff"] for r in rows]
    assert len(probes) == 3 and max(probes) < 1e-5  # fp32: the learner's log-probs, served
