"""The GPU kit's fp8 stage (scripts/gpu_fp8_check.py, issue 56 item 8): the block-FP8
quantizer on CUDA against the CPU and its speed, the FP8 copy's log-prob error against the BF16
model, and an FP8 server from the FP8 copy with one sync and the probe. Here: its CPU dry run
through scripts/gpu_checks.sh (the quantizer against itself, the stand-in server), and its
summary cell for a GPU run without SGLang and for one whose quantizer differs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.gpu.test_gpu_checks_dry_run import run_checks

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_kit  # noqa: E402

sys.path.pop(0)


def test_fp8_stage_dry_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    r = run_checks("--cpu-dry-run", "--stages", "fp8", str(out),
                   env={"GPU_CHECKS_WORK": str(work), "OMP_NUM_THREADS": "2"}, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[fp8] ok" in r.stdout, r.stdout[-3000:]
    [stage] = json.loads((out / "results.json").read_text())["stages"]
    assert stage["name"] == "fp8" and stage["status"] == "ok"
    cell = stage["numbers"]
    for text in ("quantizer on cpu: 15 tensors of Qwen3-0.6B's shape", "bit-exact vs CPU",
                 "log-probs FP8 copy vs BF16 (14 FP8 weights", "probe tolerance 1",
                 "server megatron_gspo.rollout.standin.server from the FP8 copy (float32",
                 "(14 FP8 tensors", "probe match"):
        assert text in cell, cell
    assert "failure" not in cell
    report = json.loads((work / "fp8.json").read_text())
    assert report["quantizer"]["mismatched"] == 0 and report["quantizer"]["s_per_gib"] > 0
    lp = report["logprobs"]
    assert 0 < lp["max_abs"] < lp["tolerance"] and lp["tokens"] == 2 * 31
    assert 0 < report["server"]["probe_max_diff"] < report["server"]["tolerance"]
    assert "| scripts/gpu_fp8_check.py | ok |" in (out / "summary.md").read_text()


def test_fp8_summary_cell_of_a_gpu_run_without_sglang_and_of_a_mismatch(tmp_path):
    quantizer = {"device": "cuda", "tensors": 197, "params": 441450496, "gib": 0.822,
                 "seconds": 0.05, "s_per_gib": 0.061, "cpu_s_per_gib": 3.2, "repeats": 3,
                 "mismatched": 0, "first_mismatch": None}
    logprobs = {"tokens": 2040, "sequences": 8, "max_abs": 0.05, "mean_abs": 0.012,
                "seq_max_abs": 0.002, "seq_beyond_clip": 1.0, "fp8_weights": 14,
                "tolerance": 1.0, "changed": True}
    (tmp_path / "stages.tsv").write_text("fp8\t0\t21.3\t40\n")
    (tmp_path / "fp8.json").write_text(json.dumps({
        "device": "NVIDIA H100", "quantizer": quantizer, "logprobs": logprobs, "failures": [],
        "server": {"status": "skipped", "reason": "sglang is not importable here"}}))
    text = gpu_kit.render_summary(tmp_path, "gpu", env={"device": "1 x NVIDIA H100"})
    row = next(ln for ln in text.splitlines() if ln.startswith("| scripts/gpu_fp8_check.py"))
    assert "| ok | 21 s |" in row
    assert ("quantizer on cuda: 197 tensors of Qwen3-0.6B's shape (441 M params, 0.82 GiB "
            "bf16) bit-exact vs CPU, 0.061 s/GiB (CPU 3.2 s/GiB)") in row
    assert "per token max abs diff 0.05, mean 0.012" in row and "100% beyond 0.0004" in row
    assert row.endswith("server: skipped: sglang is not importable here |")
    (tmp_path / "stages.tsv").write_text("fp8\t1\t21.3\t40\n")
    bad = {**quantizer, "mismatched": 2, "first_mismatch": "model.layers.0.mlp.up_proj.weight: "
           "3 fp8 bytes and 0 scales differ"}
    (tmp_path / "fp8.json").write_text(json.dumps({
        "quantizer": bad, "failures": [f"quantizer: {bad['first_mismatch']}"]}))
    text = gpu_kit.render_summary(tmp_path, "gpu", env={"device": "1 x NVIDIA H100"})
    row = next(ln for ln in text.splitlines() if ln.startswith("| scripts/gpu_fp8_check.py"))
    assert "| FAILED (exit 1) |" in row and "2 tensor(s) differ, first model.layers.0" in row
    assert "1 failure(s), first: quantizer: model.layers.0.mlp.up_proj.weight" in row
