"""Three GSPO steps on the DeepSeek Sparse Attention families (issue 55, item 4: DeepSeek-V3.2,
GLM-5; tests/convert/tiny_dsa.py) on megatron-core 0.19: embedded engine (transformers) <->
Megatron learner, weight sync after each step, the engine's log-probs equal the learner's
(fp32, 1e-4) before and after every sync, and routing replay (r2 bitwise, r3 on every MoE
layer); the learner's loss and gradients under PP2 and EP2 equal one process's (1e-5). Cases:
`_family_train_worker.py` through `_dsa_train_worker.py`. On megatron-core 0.16.1
the learner refuses these models in one line (tests/convert/test_dsa_parity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gspo.megatron.compat import version
from tests.convert.tiny_dsa import DSA_FAMILIES
from tests.megatron import _dist

WORKER = Path(__file__).with_name("_dsa_train_worker.py")


@pytest.mark.parametrize("arch", sorted(DSA_FAMILIES))
def test_dsa_three_gspo_steps_sync_and_replay(arch, tmp_path, monkeypatch):
    if version() < (0, 19, 0):  # no PyTorch DSA path: refused at config time
        from megatron_gspo.megatron.learner import Learner
        from tests.convert.tiny_dsa import make_dsa_model

        make_dsa_model(arch, tmp_path)
        import json

        with pytest.raises(ValueError, match="needs megatron-core >= 0.19"):
            Learner(json.loads((tmp_path / "config.json").read_text()))
        return
    monkeypatch.setattr(_dist, "WORKERS", WORKER)
    rep = _dist.launch(f"train-{arch}", 1, tmp_path, timeout=600)[0]
    print(f"\n{arch}: {rep['info']}")
    assert rep["failures"] == [], rep["failures"]
    info = rep["info"]
    assert len(info["steps"]) == 3 and info["moved"] > 0
    assert max(info["engine_vs_learner_lp"]) <= 1e-4
    assert info["r3"]["moe/routers_replayed_share"] == 1.0 and info["r3_layers"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(DSA_FAMILIES))
def test_dsa_learner_pp2_ep2_match_one_process(arch, tmp_path, monkeypatch):
    """The learner's GSPO loss and gradients under PP2 (GLM-5: top-k sharing inside each stage)
    and EP2 equal one process's (1e-5)."""
    if version() < (0, 19, 0):
        return
    monkeypatch.setattr(_dist, "WORKERS", WORKER)
    _dist.launch(f"ref-{arch}", 1, tmp_path, timeout=600)
    reps = _dist.launch(f"par-{arch}", 2, tmp_path, timeout=900)
    for rank, rep in enumerate(reps):
        assert rep["failures"] == [], f"rank {rank}: {rep['failures']}"
    info = reps[0]["info"]
    print(f"\n{arch}: {info}")
    assert {"pp2", "ep2"} <= set(info)
