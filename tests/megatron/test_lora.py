"""LoRA on the Megatron learner (`megatron_gspo/megatron/lora.py`): the single-process checks
(float64 layer reference, base identity at B = 0, merged-model equivalence and chain-rule
gradients, GSPO / GSPO-token steps that move only the adapters, partial weight sync, KL to the
adapters-off base, adapter-only checkpoints with bit-identical resume, the PEFT export loaded
by `peft`) and, in the slow tier, TP2 / TP2+SP / PP2 / DP2 / EP2 against them. The cases live
in `_lora_worker.py` (the single-process one: about 10 s of CPU time, 13-24 s wall on
2 busy cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron import _dist


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def single(workdir):
    mp = pytest.MonkeyPatch()
    mp.setattr(_dist, "WORKERS", Path(__file__).with_name("_lora_worker.py"))
    try:
        yield _dist.launch("lora1", 1, workdir, timeout=400)[0]
    finally:
        mp.undo()


def test_lora_single_process(single):
    assert single["failures"] == []
    info = single["info"]
    assert info["dense.adapters_moved"] == 4 * 4 * 2  # 4 layers x 4 targets x (A, B)
    assert info["moe.adapters_moved"] > 4 * 2 * 2  # attention + expert adapters
    assert info["sync.sent"] == 16  # q, k, v, down_proj of 4 layers
    assert info["peft.max_abs_logprob_diff"] <= 1e-5
    assert info["kl_loss"] > 0
    for model in ("dense", "moe"):  # the plan's state bytes (= the learner's) vs full FT
        lora_state, full_state = info[f"{model}.plan_state_bytes"]
        assert 0 < lora_state < full_state / 4


@pytest.mark.slow
def test_lora_parallel_layouts_match_single_process(single, workdir):
    mp = pytest.MonkeyPatch()
    mp.setattr(_dist, "WORKERS", Path(__file__).with_name("_lora_worker.py"))
    try:
        reps = _dist.launch("lora2", 2, workdir, timeout=600)
    finally:
        mp.undo()
    for rank, rep in enumerate(reps):
        assert rep["failures"] == [], f"rank {rank}"
    assert {"dense.tp2", "dense.tp2sp", "dense.pp2", "dense.dp2", "dense.dp2-distopt", "moe.ep2",
            "moe.tp2sp-ep2"} <= set(reps[0]["info"])
