"""KL to a frozen reference and the entropy bonus through the Megatron learner: single process
(values vs the pure-torch formula, frozen reference over 5 steps, no reference at kl_coef 0,
differentiable entropy) and TP2 / PP2 against it (loss, KL part, gradients to 1e-5).
Cases live in `_kl_worker.py` (about 10 s on 2 CPU cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron import _dist


@pytest.fixture(scope="module")
def reports(tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("mgkl")
    monkeypatch_module.setattr(_dist, "WORKERS", Path(__file__).with_name("_kl_worker.py"))
    one = _dist.launch("kl1", 1, out, timeout=300)
    two = _dist.launch("kl2", 2, out, timeout=400)
    return one, two


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_single_process_kl_frozen_reference_and_no_reference_when_off(reports):
    one, _ = reports
    assert one[0]["failures"] == []
    info = one[0]["info"]
    assert info["kl_loss"] > 0 and info["policy_moved"] > 0
    assert info["paired_schedules"] == 1  # policy + reference log-probs from one schedule


def test_tp2_pp2_match_single_process_with_kl(reports):
    _, two = reports
    for rank, rep in enumerate(two):
        assert rep["failures"] == [], f"rank {rank}"
        assert all(k in rep["info"] for k in ("tp2", "pp2", "tp2sp", "pp2vpp2"))
