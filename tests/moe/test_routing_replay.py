"""MoE routing replay (R2 / R3) through the Megatron learner and its routing metrics.
Cases live in `_replay_worker.py` (one process each, launched like tests/megatron's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron import _dist

WORKER = Path(__file__).with_name("_replay_worker.py")


def _launch(tmp_path_factory, monkeypatch, case: str, nprocs: int, timeout: float):
    monkeypatch.setattr(_dist, "WORKERS", WORKER)
    reps = _dist.launch(case, nprocs, tmp_path_factory.mktemp(f"replay_{case}"), timeout=timeout)
    for rank, rep in enumerate(reps):
        assert rep["failures"] == [], f"rank {rank}: {rep['failures']}"
    return reps


def test_r2_replay_equals_live_and_replays_records_after_a_step(tmp_path_factory, monkeypatch):
    """1 process: r2 replay gives live routing's loss and gradients bitwise (also with
    activation recompute, i.e. REPLAY_BACKWARD); the router keeps its gradient; after an
    optimizer step every replayed expert set is the recorded one while live routing moved; a
    router registered twice is a one-line error; r3 dispatches the given experts, and the last
    token's routing (no engine record) changes neither loss nor gradients."""
    info = _launch(tmp_path_factory, monkeypatch, "one", 1, 300)[0]["info"]
    assert min(info["router_grad_norms"]) > 0
    assert info["after_step"]["moe/expert_change_rate"] > 0
    # per layer: every MoE layer's share, and (every token routed at every layer) their mean
    # is the overall rate
    per = [v for k, v in info["after_step"].items() if k.startswith("moe/expert_change_rate/")]
    assert len(per) == info["moe_layers"] and all(0.0 <= v <= 1.0 for v in per)
    assert sum(per) / len(per) == pytest.approx(info["after_step"]["moe/expert_change_rate"])
    assert info["after_step"]["moe/routers_replayed_share"] == 1.0
    assert info["replayed_checked"] > 300 and info["r3_checked"] > 300
    assert "layers [2]" in info["orphan_error"]
    assert info["global_router_instances"] > 4  # Megatron's global list keeps orphans
    assert info["r3_metrics"]["moe/tokens_without_routing_record"] == 8  # one per sample


@pytest.mark.slow
def test_r2_replay_equals_live_under_tp_sp_ep_pp_vpp_dp(tmp_path_factory, monkeypatch):
    """2 processes: TP2+SP+EP2, PP2, PP2+VPP2 and DP2, each bitwise against live routing in the
    same layout; the replayed experts equal the records on this rank's layers and tokens."""
    reps = _launch(tmp_path_factory, monkeypatch, "par", 2, 600)
    for rep in reps:
        for name in ("tp2-sp-ep2", "pp2", "pp2-vpp2", "dp2"):
            assert rep["info"][name]["checked"] > 0, name
    losses = {round(v["loss"], 6) for r in reps for v in r["info"].values()}
    assert len(losses) == 1  # same weights, same mini-batch: the same loss in every layout


@pytest.mark.slow
def test_r3_agreement_bf16_engine_vs_fp32_learner(tmp_path_factory, monkeypatch):
    """The MoE demo model, embedded engine in bfloat16, learner in float32: the agreement
    metric is below 1 and equals a direct count; r3 dispatches the engine's experts."""
    info = _launch(tmp_path_factory, monkeypatch, "engine", 1, 300)[0]["info"]
    m = info["metrics"]
    assert 0.9 < m["moe/routing_agreement/min"] <= m["moe/routing_agreement/mean"] < 1.0
    assert info["learner_equals_hf_fp32"] > 0.99
    assert info["replayed_checked"] > 1000
