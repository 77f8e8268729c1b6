"""Speculative rollouts of the embedded engine in the RL loop (issue 58 items 3-4;
`loop/speculative_setting.py`, `rollout/embedded_speculative.py`): the tiny demo with an added
MTP layer trained online and `rollout.speculative.algorithm: mtp`. The weight sync hands the
engine the head (`speculative/ready` 1 from the first step), every step drafts (`adaptive:
false`) with an acceptance in (0, 1], and the logged keys are declared (`loop.metric_keys`).
With the adaptive switch at its default `max_batch` below the step's rows nothing drafts and
the reason says why (3: batch)."""

from __future__ import annotations

import json

import pytest

from megatron_gspo.loop.metric_keys import find_entry
from megatron_gspo.rollout.speculative_control import REASONS
from tests.loop.test_mtp_train import ROOT, _train

DEMO = ROOT / "examples" / "tiny" / "base"
ON = ("model.mtp_layers=add", "algorithm.mtp_loss_weight=1", "rollout.speculative.algorithm=mtp")


def _rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_loop_drafts_with_the_synced_head(tmp_path):
    r = _train(DEMO, tmp_path / "run", *ON, "rollout.speculative.adaptive=false")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert row["speculative/ready"] == 1.0 and row["speculative/on"] == 1.0, row
        assert row["speculative/reason"] == REASONS["fixed"]
        assert 0.0 < row["speculative/acceptance"] <= 1.0, row
        assert row["speculative/tokens_per_verify"] >= 1.0 and row["mtp/tokens"] > 0
        spec = [k for k in row if k.startswith("speculative/")]
        assert all(find_entry(k) for k in spec), spec


@pytest.mark.slow  # the switch itself: tests/rollout/test_embedded_speculative.py
def test_the_adaptive_switch_keeps_large_batches_plain(tmp_path):
    r = _train(DEMO, tmp_path / "run", *ON, "rollout.speculative.max_batch=8")  # 16 rows
    assert r.returncode == 0, r.stderr[-3000:]
    for row in _rows(tmp_path / "run"):
        assert row["speculative/on"] == 0.0 and row["speculative/batch"] == 16.0, row
        assert row["speculative/reason"] == REASONS["batch"]
        assert "speculative/acceptance" not in row
