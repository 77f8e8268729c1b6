"""SAPO, CISPO, GMPO, Dr. GRPO and off-policy sequence masking through the Megatron learner,
each with the KL and entropy terms on: TP2, PP2 and DP2 give the single process's loss and
gradients to 1e-6 (relative norm) and the same counters. Cases live in `_family_worker.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron import _dist

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("mgfam")
    mp = pytest.MonkeyPatch()
    mp.setattr(_dist, "WORKERS", Path(__file__).with_name("_family_worker.py"))
    try:
        one = _dist.launch("fam1", 1, out, timeout=400)
        two = _dist.launch("fam2", 2, out, timeout=600)
    finally:
        mp.undo()
    return one, two


def test_single_process_cases_exercise_kl_clipping_and_masking(reports):
    one, _ = reports
    assert one[0]["failures"] == []
    info = one[0]["info"]
    assert info["cispo"]["clip_fraction"] > 0
    assert info["gspo_offpolicy"]["offpolicy_masked_share"] > 0


def test_tp2_pp2_dp2_match_single_process_for_every_family_loss(reports):
    _, two = reports
    for rank, rep in enumerate(two):
        assert rep["failures"] == [], f"rank {rank}"
        assert all(k in rep["info"] for k in ("tp2", "pp2", "dp2"))
