"""Precision tolerance on real components: the embedded engine (bf16 and fp32) against the
fp32 Megatron learner on the same weights; `auto` fallback and return; first-ratio identity."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_worker.py")


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=str(WORKER.parents[2]))
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


def test_bf16_engine_mismatch_is_real_finite_and_ordered(result):
    bf, fp = result["bfloat16"]["audit"], result["float32"]["audit"]
    for a in (bf, fp):
        assert all(v == v and abs(v) < 1e3 for v in a.values())  # finite
    assert bf["token_abs_diff_mean"] > 100 * fp["token_abs_diff_mean"]
    assert bf["seq_abs_mismatch_mean"] > 100 * fp["seq_abs_mismatch_mean"]
    assert bf["k3_kl"] > 1e4 * fp["k3_kl"]
    assert fp["token_abs_diff_max"] < 1e-5 and fp["out_of_range_fraction"] == 0.0
    assert bf["out_of_range_fraction"] > 0.0


def test_audit_matches_direct_computation(result):
    for dt in ("bfloat16", "float32"):
        r = result[dt]
        assert r["learner_vs_direct_max"] < 1e-5
        a, d = r["audit"], r["direct"]
        assert a["sequences"] == d["sequences"]
        tol = 1e-6
        for k in ("token_abs_diff_mean", "seq_abs_mismatch_mean", "seq_mismatch_mean"):
            assert abs(a[k] - d[k]) < tol, (dt, k, a[k], d[k])
    bf = result["bfloat16"]
    assert bf["audit"]["out_of_range_fraction"] == pytest.approx(
        bf["direct"]["out_of_range_fraction"], abs=1 / 16)


def test_rollout_old_logprobs_first_ratio_is_exp_d(result):
    r = result["first_ratio"]
    assert abs(r["exp_d_max"] - 1.0) > 1e-4  # a real (bf16) mismatch, not a trivial 1
    for k in ("mean", "min", "max"):
        assert r[f"ratio_{k}"] == pytest.approx(r[f"exp_d_{k}"], abs=1e-6)


def test_auto_falls_back_and_returns(result):
    sources = [s for _, _, s in result["auto_trace"]]
    fracs = [f for _, f, _ in result["auto_trace"]]
    assert sources[0] == "rollout" and fracs[0] == 0.0
    assert sources[1] == "recompute" and fracs[1] > 0.2  # stale engine weights
    assert sources[3:] == ["recompute", "rollout", "rollout"]  # synced at 3, back at 4
    switches = [e["switch"] for e in result["auto_events"]]
    assert switches == ["rollout->recompute", "recompute->rollout"]
