"""The GPU kit's colocated stage (scripts/gpu_colocated_check.py, issue 53 defect 8): a real
SGLang server on the learner's GPU synced through update_weights_from_tensor (CUDA IPC), then
the sync probe. Here: its CPU dry run (the stand-in server, CPU tensors in shared memory) through
scripts/gpu_checks.sh, which must show a match after each sync and the mismatch of the control
(weights changed, not synced); and its summary cell for a GPU run and for a skipped one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.gpu.test_gpu_checks_dry_run import run_checks

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_kit  # noqa: E402

sys.path.pop(0)


def test_colocated_stage_dry_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    r = run_checks("--cpu-dry-run", "--stages", "colocated", str(out),
                   env={"GPU_CHECKS_WORK": str(work), "OMP_NUM_THREADS": "2"}, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[colocated] ok" in r.stdout, r.stdout[-3000:]
    [stage] = json.loads((out / "results.json").read_text())["stages"]
    assert stage["name"] == "colocated" and stage["status"] == "ok"
    cell = stage["numbers"]
    assert cell.startswith("CPU shared memory to megatron_gspo.rollout.standin.server (float32")
    for text in ("sync v0 ", "probe v0 match (expected match)",
                 "probe v1 mismatch (expected mismatch)", "sync v1 ",
                 "probe v1 match (expected match)"):
        assert text in cell, cell
    assert "failure" not in cell
    report = json.loads((work / "colocated.json").read_text())
    syncs = [s for s in report["steps"] if s["step"].startswith("sync")]
    assert len(syncs) == 2 and all(s["buckets"] >= 2 for s in syncs)  # 1 MiB buckets
    control = report["steps"][2]
    assert control["max_diff"] > report["tolerance"]  # the probe can fail
    summary = (out / "summary.md").read_text()
    assert "| scripts/gpu_colocated_check.py | ok |" in summary


def test_colocated_summary_cell_of_a_gpu_run_and_of_a_skip(tmp_path):
    (tmp_path / "stages.tsv").write_text("colocated\t1\t41.5\t60\n")
    (tmp_path / "colocated.json").write_text(json.dumps({
        "status": "ran", "server": "sglang.launch_server", "dtype": "bfloat16",
        "tolerance": 0.15, "path": "CUDA IPC", "launch_seconds": 24.2, "device": "NVIDIA H200",
        "steps": [
            {"step": "sync v0", "seconds": 0.41, "buckets": 8.0, "bytes": 7 * 2**20},
            {"step": "probe v0", "seconds": 0.3, "max_diff": 0.031, "result": "match",
             "expected": "match"},
            {"step": "probe v1", "seconds": 0.3, "max_diff": 0.04, "result": "match",
             "expected": "mismatch"}],
        "failures": ["probe v1: match, expected mismatch"]}))
    text = gpu_kit.render_summary(tmp_path, "gpu", env={"device": "1 x NVIDIA H200"})
    row = next(ln for ln in text.splitlines() if ln.startswith("| scripts/gpu_colocated"))
    assert "| FAILED (exit 1) | 42 s |" in row
    assert "CUDA IPC to sglang.launch_server (bfloat16, probe tolerance 0.15)" in row
    assert "launch 24.2 s; sync v0 0.41 s (8 buckets, 7.0 MiB)" in row
    assert "probe v0 match (expected match) max diff 0.031 in 0.30 s" in row
    assert "1 failure(s), first: probe v1: match, expected mismatch" in row
    (tmp_path / "stages.tsv").write_text("colocated\t0\t3.0\t60\n")
    (tmp_path / "colocated.json").write_text(json.dumps({
        "status": "skipped", "reason": "sglang is not importable here", "device": "H200"}))
    text = gpu_kit.render_summary(tmp_path, "gpu", env={"device": "1 x NVIDIA H200"})
    assert "| ok | 3 s | skipped: sglang is not importable here |" in text
