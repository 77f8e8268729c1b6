"""scripts/gpu_sglang_check.py's checks on the CPU against the stand-in server, which follows
SGLang 0.5.12's rules: a server without --enable-weights-cpu-backup loses its weights when it
releases memory, so the check must push them again before comparing answers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDIN = "megatron_gspo.rollout.standin.server"


@pytest.mark.slow
def test_sglang_check_passes_against_the_standin(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_sglang_check import run_checks
    finally:
        sys.path.pop(0)
    ok = run_checks(str(tmp_path), module=STANDIN)
    out = capsys.readouterr().out
    assert ok, out
    assert "[PASS] release/resume memory + weight push" in out
    assert out.count("[PASS]") == 8 and "[FAIL]" not in out
