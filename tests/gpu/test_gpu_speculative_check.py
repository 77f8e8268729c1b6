"""The GPU kit's speculative stage (scripts/gpu_speculative_check.py, issue 58 item 5): exactness
of speculative sampling and of the embedded engine's drafting on the device, and the per-call
costs that predict the speed-up. Here: its CPU dry run through scripts/gpu_checks.sh; a broken
verification (every draft accepted) and a broken KV cache (the rejected slots left unmasked)
each fail the exactness checks; the cost analysis on known costs."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.algo import speculative_sampling as ss
from megatron_gspo.rollout import embedded_speculative as es
from tests.gpu.test_gpu_checks_dry_run import run_checks

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_speculative_check as gsc  # noqa: E402

sys.path.pop(0)


def test_speculative_stage_dry_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    r = run_checks("--cpu-dry-run", "--stages", "speculative", str(out),
                   env={"GPU_CHECKS_WORK": str(work), "OMP_NUM_THREADS": "1"}, timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[speculative] ok" in r.stdout, r.stdout[-3000:]
    [stage] = json.loads((out / "results.json").read_text())["stages"]
    assert stage["name"] == "speculative" and stage["status"] == "ok"
    assert float(stage["seconds"]) < 60
    cell = stage["numbers"]
    for text in ("verify_chain on cpu: chi2", "5000 rows, K=2", "engine float32: sampled",
                 "engine bfloat16: sampled", "greedy = plain in 4/4 rows",
                 "batch 1 (2 layers, hidden 64, vocab 512, bf16): plain step",
                 "break-even acceptance K=1/2/3", "ratio="):
        assert text in cell, cell
    assert "failure" not in cell
    rep = json.loads((work / "speculative.json").read_text())
    v = rep["verify_chain"]
    assert v["ok"] and 0 < v["chi2"] < v["bound"] and 0.1 < v["acceptance"] < 0.9
    for e in rep["engine"]:
        assert e["failures"] == [] and e["sampled_max_abs"] <= e["tol"] and e["greedy_same"] == 4
    assert rep["engine"][0]["dtype"] == "float32" and rep["engine"][0]["sampled_max_abs"] < 1e-5
    costs = rep["costs"]
    assert set(costs["batches"]) == {"1", "16"} and set(costs["analysis"]["1"]) == {"1", "2", "3"}
    for c in costs["batches"].values():
        assert all(ms > 0 for part in c.values() for ms in part.values())
    assert gsc.ratio(rep) == max(a["speedup"]["0.77"] for a in costs["analysis"]["1"].values())
    assert f"ratio={gsc.ratio(rep):.3f}" in (work / "speculative.log").read_text()
    assert "| scripts/gpu_speculative_check.py | ok |" in (out / "summary.md").read_text()


def test_a_verification_that_accepts_every_draft_fails(monkeypatch):
    real = ss.verify_chain

    def accept_all(p, q, draft, u, draw, greedy=None, target_argmax=None):
        return real(p, q, draft, torch.zeros_like(u) - 1, draw)  # u * q < p: always accepted

    monkeypatch.setattr(ss, "verify_chain", accept_all)
    monkeypatch.setattr(es, "verify_chain", accept_all)
    v = gsc.check_verify_chain("cpu", 5000)
    assert not v["ok"] and v["chi2"] > 3 * v["bound"] and v["acceptance"] == 1.0
    e = gsc.check_engine("cpu", "float32")
    assert any("greedy drafting differs from plain greedy decoding" in f for f in e["failures"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rejected_slots_left_unmasked_fail(monkeypatch, dtype):
    """The decode loop with every verified slot kept in the attention mask: the rejected drafts'
    keys leak into later tokens, and the log-probs leave the teacher-forced ones."""
    src = inspect.getsource(es)
    leak = src.replace("keep = (torch.arange(K + 1, device=dev)[None] <= acc[:, None])"
                       ".to(mask.dtype)", "keep = torch.ones(B, K + 1, dtype=mask.dtype, "
                       "device=dev)")
    assert leak != src
    ns = {"__name__": "leaky_speculative"}
    exec(compile(leak, es.__file__, "exec"), ns)  # noqa: S102 - the module with one line changed
    monkeypatch.setattr(es, "speculative_decode", ns["speculative_decode"])
    e = gsc.check_engine("cpu", dtype)
    assert e["sampled_max_abs"] > 10 * e["tol"]
    assert any("sampled log-probs" in f for f in e["failures"])


def test_cost_analysis_of_known_costs():
    c = {"target": {"1": 10.0, "2": 10.0, "3": 10.0, "4": 10.0},
         "draft": {"1": 0.5, "2": 0.5, "3": 0.5, "4": 0.5},
         "verify_chain": {"1": 0.0, "2": 0.0, "3": 0.0}}
    a = gsc.analyse(c)
    assert [a[k]["verify_ms"] for k in "123"] == [10.5, 11.0, 11.5]
    assert a["1"]["break_even_acceptance"] == pytest.approx(0.05)
    assert a["2"]["break_even_tokens"] == pytest.approx(1.1)
    assert a["2"]["speedup"]["0.77"] == pytest.approx((1 + 0.77 + 0.77 ** 2) * 10 / 11)
    assert a["3"]["speedup"]["0.5"] == pytest.approx(1.875 * 10 / 11.5)
    c["target"]["2"] = 25.0  # a verification beyond 2 plain steps: K = 1 never breaks even
    assert gsc.analyse(c)["1"]["break_even_acceptance"] is None
