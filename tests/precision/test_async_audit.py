"""pi_old and the split precision audit of a batch mixing current-version and stale samples
(`phases.old_logprobs` in `rollout.mode: async`, `megatron_gspo/loop/stale_audit.py`)."""

from __future__ import annotations

import pytest

from megatron_gspo.loop import phases
from megatron_gspo.algo.precision import ToleranceController
from megatron_gspo.config import config_from_dict
from megatron_gspo.data.sample import Sample

STEP = 5


class FakeLearner:
    """forward_logprobs answers the 'learner' log-probs stored in each sample's metadata."""

    def __init__(self):
        self.calls = 0

    def forward_logprobs(self, samples, reference=False):
        self.calls += 1
        return [list(s.metadata["learner"]) for s in samples]


def _batch(stale_shift=0.05):
    """4 current samples (learner == engine up to 1e-6) and 4 stale ones (version STEP - 1)
    whose engine log-probs differ from the learner's by `stale_shift` per token."""
    out = []
    for i in range(8):
        stale = i >= 4
        eng = [-0.5 - 0.1 * t for t in range(6)]
        lrn = [x + (stale_shift if stale else 1e-6) for x in eng]
        v = STEP - 1 if stale else STEP
        out.append(Sample([1, 2], [3] * 6, rollout_logprobs=eng, index=i, group_index=i // 4,
                          weight_version=v, token_versions=[v] * 6, advantage=1.0,
                          metadata={"learner": lrn}))
    return out


def _cfg(old="auto", correction="none"):
    audit = {} if old == "recompute" else {"audit_fraction": 1.0}  # recompute: every step
    return config_from_dict({"rollout": {"mode": "async"},
                             "precision": {"old_logprobs": old, "correction": correction,
                                           **audit}})


def _controller(cfg):
    p = cfg.precision
    return ToleranceController(p.old_logprobs, p.audit_fraction, p.tolerance, p.recheck_interval)


def test_auto_decides_on_current_samples_only():
    cfg = _cfg("auto")
    ctl = _controller(cfg)
    old, source, m = phases.old_logprobs(cfg, FakeLearner(), ctl, _batch(), STEP)
    assert source == "rollout" and old is None and not ctl.events
    assert m["precision/sequences"] == 4 and m["precision/out_of_range_fraction"] == 0.0
    assert m["precision/stale/sequences"] == 4
    assert m["precision/stale/out_of_range_fraction"] == 1.0  # staleness, reported apart
    assert m["precision/stale/seq_mismatch_mean"] == pytest.approx(0.05, abs=1e-6)
    assert (m["precision/current_samples"], m["precision/stale_samples"]) == (4, 4)


def test_auto_still_falls_back_on_current_mismatch():
    cfg = _cfg("auto")
    ctl = _controller(cfg)
    batch = _batch(stale_shift=0.0)
    for s in batch[:4]:
        s.metadata["learner"] = [x + 0.01 for x in s.rollout_logprobs]
    old, source, m = phases.old_logprobs(cfg, FakeLearner(), ctl, batch, STEP)
    assert source == "recompute" and ctl.events[0]["switch"] == "rollout->recompute"
    assert m["precision/stale/out_of_range_fraction"] == 0.0
    for s, o in zip(batch, old, strict=True):  # current: learner's; stale: the engine's
        assert o == (s.metadata["learner"] if s.weight_version == STEP else s.rollout_logprobs)


def test_recompute_keeps_engine_logprobs_as_pi_old_of_stale_samples():
    cfg = _cfg("recompute")
    batch = _batch()
    old, source, _m = phases.old_logprobs(cfg, FakeLearner(), _controller(cfg), batch, STEP)
    assert source == "recompute"
    assert old[:4] == [s.metadata["learner"] for s in batch[:4]]
    assert old[4:] == [s.rollout_logprobs for s in batch[4:]]


@pytest.mark.parametrize("correction", ["mask", "mis", "icepop"])
def test_correction_never_masks_stale_samples(correction):
    cfg = _cfg("auto", correction=correction)
    batch = _batch(stale_shift=2.0)  # k = e^2 > 5 per token, weight e^2 > C = 2
    _old, _source, m = phases.old_logprobs(cfg, FakeLearner(), _controller(cfg), batch, STEP)
    assert all(s.num_trainable == 6 for s in batch)
    assert m["precision/masked_sequences"] == 0


def test_a_batch_of_current_samples_takes_the_sync_path():
    cfg = _cfg("auto")
    batch = _batch()[:4]
    _old, _source, m = phases.old_logprobs(cfg, FakeLearner(), _controller(cfg), batch, STEP)
    assert "precision/stale_samples" not in m and m["precision/sequences"] == 4
