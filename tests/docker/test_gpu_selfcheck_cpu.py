"""tools/gpu_selfcheck.py without CUDA: a full table of skipped GPU rows and exit code 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_selfcheck.py"
GPU_ROWS = ["cuda devices", "nccl all-reduce", "transformer-engine", "apex",
            "TE-spec GPTModel fwd/bwd", "sglang server round trip"]


def test_cpu_only_machine_prints_skipped_rows_and_exits_0(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the CPU-only path is not taken")
    out_json = tmp_path / "rows.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(TOOL), "--json", str(out_json)], check=False,
                       env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["check", "status", "detail"]
    for name in GPU_ROWS:
        [row] = [ln for ln in lines if ln.startswith(name + " ")]
        assert "skipped: no CUDA" in row
    assert "No CUDA device visible: the GPU checks were skipped" in r.stdout
    report = json.loads(out_json.read_text())
    assert report["cuda"] is False
    status = {row["check"]: row["status"] for row in report["rows"]}
    assert status["torch"] == "ok" and status["megatron-core"] == "ok"
    assert all(status[n] == "skipped: no CUDA" for n in GPU_ROWS)


def test_table_alignment_and_failed_exit_code(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_selfcheck as sc
    finally:
        sys.path.pop(0)
    rows = [sc.Row("torch", "ok", "2.x"), sc.Row("nccl all-reduce", "FAIL", "rank 1: timed out")]
    table = sc.format_table(rows).splitlines()
    col = table[0].index("status")  # the status column lines up under its header
    assert table[2][col:col + 2] == "ok" and table[3][col:col + 4] == "FAIL"
    assert table[3].split()[:3] == ["nccl", "all-reduce", "FAIL"]
    monkeypatch.setattr(sc, "run_checks", lambda *a: (rows, True))
    assert sc.main([]) == 1
    assert "FAILED: nccl all-reduce" in capsys.readouterr().err


def test_sglang_round_trip_against_a_server_with_sglangs_api(tmp_path):
    """The round-trip check launches a server with SGLang's flags, waits for /health, POSTs
    /generate and stops it; here the server is the project's stand-in (same endpoints, CPU)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_selfcheck as sc
    finally:
        sys.path.pop(0)
    # "tiny": the check builds its own random Qwen3 directory (no tokenizer, token ids only).
    row = sc.check_sglang("tiny", timeout_s=90, module="megatron_gspo.rollout.standin.server")
    assert row.status == "ok", row
    assert "16 tokens + 16 logprobs" in row.detail
    bad = sc.check_sglang(str(tmp_path), timeout_s=5, module="megatron_gspo.rollout.standin.server")
    assert bad.status == "FAIL" and "no config.json" in bad.detail


def _selfcheck():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_selfcheck as sc
    finally:
        sys.path.pop(0)
    return sc


def test_free_port_stays_within_sglangs_port_bound():
    """SGLang 0.5.12 refuses a --port above 55535 (it sets grpc_port = port + 10000 <= 65535);
    about one OS-picked port in five is above it."""
    sc = _selfcheck()
    ports = [sc.free_port() for _ in range(60)]
    assert max(ports) <= 55535, sorted(ports)[-5:]
    assert min(ports) >= 1024


def test_absent_te_and_apex_are_skipped_only_when_allowed():
    import importlib.util

    if importlib.util.find_spec("transformer_engine") or importlib.util.find_spec("apex"):
        pytest.skip("Transformer Engine or apex is installed here")
    sc = _selfcheck()
    assert sc.check_te(allow_missing=True) == sc.Row("transformer-engine",
                                                     "skipped: not installed")
    assert sc.check_apex(allow_missing=True) == sc.Row("apex", "skipped: not installed")
    assert sc.check_te().status == "FAIL" and sc.check_apex().status == "FAIL"


def test_absent_apex_is_skipped_where_te_provides_fused_adam(monkeypatch):
    """The GPU image has no apex: megatron-core takes FusedAdam from Transformer Engine."""
    import importlib.util

    if importlib.util.find_spec("apex"):
        pytest.skip("apex is installed here")
    sc = _selfcheck()
    monkeypatch.setattr(sc, "_te_fused_adam", lambda: True)
    row = sc.check_apex()
    assert row.status.startswith("skipped: not installed") and "FusedAdam" in row.status
    monkeypatch.setattr(sc, "_te_fused_adam", lambda: False)
    assert sc.check_apex().status == "FAIL"
