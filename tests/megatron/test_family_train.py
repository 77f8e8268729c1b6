"""Three GSPO steps per model family beyond Llama / Qwen (tests/convert/tiny_families.py),
embedded engine <-> Megatron learner with weight sync after each step, and routing replay (r2,
r3) for the MoE families. Cases live in `_family_train_worker.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.convert.tiny_families import FAMILIES, fast_first
from tests.megatron import _dist

WORKER = Path(__file__).with_name("_family_train_worker.py")


@pytest.mark.parametrize("arch", [fast_first(a) for a in sorted(FAMILIES)])
def test_three_gspo_steps_sync_and_replay(arch, tmp_path, monkeypatch):
    monkeypatch.setattr(_dist, "WORKERS", WORKER)
    rep = _dist.launch(f"train-{arch}", 1, tmp_path, timeout=600)[0]
    print(f"\n{arch}: {rep['info']}")
    assert rep["failures"] == [], rep["failures"]
    info = rep["info"]
    assert len(info["steps"]) == 3 and info["moved"] > 0
    assert max(info["engine_vs_learner_lp"]) <= 1e-4
    if "r3" in info:
        assert info["r3"]["moe/routers_replayed_share"] == 1.0
        assert info["r3_layers"], "no per-layer agreement: r3 matched no layer"


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_learner_tp2_pp2_ep2_match_one_process(arch, tmp_path, monkeypatch):
    """The learner's sharding of full weights (expert bias, sinks, sandwich norms included):
    TP2 (+SP for MoE), PP2 and EP2 give one process's GSPO loss and gradients to 1e-5
    (DeepSeek-V3's MLA under TP2+SP with replicated down projections; before and after:
    test_mla_tensor_parallel.py)."""
    monkeypatch.setattr(_dist, "WORKERS", WORKER)
    _dist.launch(f"ref-{arch}", 1, tmp_path, timeout=600)
    reps = _dist.launch(f"par-{arch}", 2, tmp_path, timeout=900)
    for rank, rep in enumerate(reps):
        assert rep["failures"] == [], f"rank {rank}: {rep['failures']}"
    info = reps[0]["info"]
    print(f"\n{arch}: {info}")
    assert {"tp2", "pp2"} <= set(info)
