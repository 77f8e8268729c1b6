"""Multi-process learner checks over gloo (CPU): the same full weights and data under
TP / PP / VPP / EP / SP / DP layouts (4 ranks) give the single-process loss, GSPO clip
statistics, gradients and post-step parameters; micro-batch splits (1, 2, 4) agree; packing,
vocab-parallel log-probs and the context-parallel per-sequence reduction are exact.
The cases live in `_workers.py`; one launch per case keeps the import cost to two rounds."""

from __future__ import annotations

import pytest

from tests.megatron._dist import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("mg")
    ref = launch("ref", 1, out, timeout=300)
    par = launch("par", 4, out, timeout=420)
    return ref, par


def _fails(rep, prefix=None):
    f = rep["failures"]
    return [x for x in f if prefix is None or x.startswith(prefix)]


def test_reference_microbatch_split_and_packing(reports):
    ref, _ = reports
    assert _fails(ref[0]) == []
    # the data really exercises the GSPO clip (neither none nor all sequences clipped)
    assert 0.0 < ref[0]["info"]["moe.clip_fraction"] < 1.0
    assert ref[0]["info"]["cpu_trace_sites"] > 0  # cpu.enable(trace=True) names call sites


def test_vocab_parallel_logprobs_tp2(reports):
    _, par = reports
    for rep in par:
        assert _fails(rep, "vocab-parallel") == []


def test_context_parallel_sequence_reduction(reports):
    _, par = reports
    for rep in par:
        assert _fails(rep, "cp ") == []


def test_parallel_layouts_match_single_process(reports):
    _, par = reports
    for rank, rep in enumerate(par):
        assert _fails(rep) == [], f"rank {rank}"
    ran = set(par[0]["info"])
    for tag in ("moe.tp2-sp", "moe.pp2", "moe.ep2", "moe.tp2-ep2-sp", "moe.pp2-vpp2",
                "moe.dp4-m2", "moe.tp2-sp-distopt", "moe.dp2-pp2-grpo-token-mean",
                "dense.tp2-pp2", "dense.tp2-sp-dp2", "dense.tp2-dp2",
                "dense.ckpt-load-pp2-dp2"):
        assert tag in ran, f"layout {tag} did not run"
