"""Qwen3-Next through the learner: three GSPO steps with the embedded engine (transformers,
its cache for the linear-attention layers) and weight sync after each step, engine and learner
log-probs equal (1e-4), r2 / r3 routing replay (`_family_train_worker.case_train`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.convert.tiny_qwen3_next import ARCH
from tests.megatron import _dist

WORKER = Path(__file__).with_name("_qwen3_next_train_worker.py")


@pytest.mark.slow  # 20 s on 0.16.1, 35 s on 0.19.2 (2 busy cores)
def test_three_gspo_steps_sync_and_replay(tmp_path, monkeypatch):
    monkeypatch.setattr(_dist, "WORKERS", WORKER)
    rep = _dist.launch(f"train-{ARCH}", 1, tmp_path, timeout=600)[0]
    print(f"\n{ARCH}: {rep['info']}")
    assert rep["failures"] == [], rep["failures"]
    info = rep["info"]
    assert len(info["steps"]) == 3 and info["moved"] > 0
    assert max(info["engine_vs_learner_lp"]) <= 1e-4
    assert info["r3"]["moe/routers_replayed_share"] == 1.0
    assert info["r3_layers"], "no per-layer agreement: r3 matched no layer"


@pytest.mark.slow
def test_learner_pp2_ep2_match_one_process(tmp_path, monkeypatch):
    """The learner's PP2, EP2 and TP2 + SP GSPO loss and gradients = one process's (1e-5)."""
    monkeypatch.setattr(_dist, "WORKERS", WORKER)
    _dist.launch(f"ref-{ARCH}", 1, tmp_path, timeout=600)
    reps = _dist.launch(f"pe-{ARCH}", 2, tmp_path, timeout=900)
    for rank, rep in enumerate(reps):
        assert rep["failures"] == [], f"rank {rank}: {rep['failures']}"
    print(f"\n{ARCH}: {reps[0]['info']}")
    assert {"pp2", "ep2", "tp2sp"} <= set(reps[0]["info"])
