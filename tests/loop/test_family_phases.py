"""The loop's advantage and pi_old phases with the GSPO-family options: DAPO's soft overlong
punishment changes rewards before the group advantages and its filter masks truncated
responses; each precision correction reports the share it masked under its own name."""

from __future__ import annotations

import math

import pytest

from megatron_gspo.loop import phases
from megatron_gspo.algo.precision import ToleranceController
from megatron_gspo.config import config_from_dict
from megatron_gspo.data.sample import Sample


class ConstLearner:
    """Learner stand-in whose log-probs are given per sample and token."""

    def __init__(self, rows):
        self.rows = rows

    def forward_logprobs(self, samples, **_):
        return [list(r) for r in self.rows]


def _samples(lengths, reasons, engine=None):
    return [Sample(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), reward=float(i % 2),
                   index=i, group_index=i // 2, finish_reason=r,
                   rollout_logprobs=None if engine is None else list(engine[i]))
            for i, (n, r) in enumerate(zip(lengths, reasons, strict=True))]


def test_overlong_punishment_precedes_advantages_and_filter_masks_truncated():
    cfg = config_from_dict({}, ["rollout.group_size=2", "train.prompts_per_step=2",
                                "rollout.max_new_tokens=8", "reward.overlong_buffer=4",
                                "reward.overlong_filter=true"])
    engine = [[-0.5] * n for n in (4, 8, 6, 8)]
    s = _samples([4, 8, 6, 8], ["stop", "length", "stop", "length"], engine)
    m = phases.fill_advantages(cfg, s)
    # rewards 0, 1, 0, 1 + penalties 0, -1, -0.5, -1 -> 0, 0, -0.5, 0
    assert [x.reward for x in s] == pytest.approx([0.0, 0.0, -0.5, 0.0])
    assert [x.advantage for x in s][:2] == [0.0, 0.0]  # equal rewards: no signal
    assert s[2].advantage < 0 < s[3].advantage
    assert [x.num_trainable for x in s] == [4, 0, 6, 0]
    assert m["reward/overlong_filtered_share"] == 0.5
    assert m["reward/overlong_penalty_mean"] == pytest.approx(-2.5 / 4)
    # the filtered samples pass the engine log-prob checks and audit of the pi_old phase
    p = cfg.precision
    ctl = ToleranceController(p.old_logprobs, p.audit_fraction, p.tolerance, p.recheck_interval)
    _, _, pm = phases.old_logprobs(cfg, ConstLearner([[-0.5] * n for n in (4, 8, 6, 8)]), ctl,
                                   s, 0)
    assert pm["precision/sequences"] == 2.0  # the audit covers the trained samples only


@pytest.mark.parametrize("correction, key, share", [
    ("mask", "precision/masked_share/mask", 0.5),  # |d_1| = 1 and |d_3| = 2/3 exceed 0.1
    ("mis", "precision/masked_share/mis", 0.25),
    ("icepop", "precision/masked_share/icepop", 1 / 12),
    ("tis", "precision/tis_truncated_share", 0.25)])
def test_each_correction_reports_its_masked_share(correction, key, share):
    over = {"mask": ["precision.mask_bound=0.1"], "mis": [], "tis": [], "icepop": []}[correction]
    cfg = config_from_dict({}, ["rollout.group_size=2", "train.prompts_per_step=2",
                                "precision.old_logprobs=recompute",
                                f"precision.correction={correction}", *over])
    engine = [[-1.0] * 3 for _ in range(4)]
    learner = [[-1.0] * 3 for _ in range(4)]
    learner[1] = [-1.0 + 1.0] * 3  # sequence 1: every token 1 nat above the engine (k = e)
    learner[3] = [-1.0, -1.0, -1.0 - 2.0]  # sequence 3: one token at k = e^-2 < 0.5
    s = _samples([3, 3, 3, 3], ["stop"] * 4, engine)
    phases.fill_advantages(cfg, s)
    before = [x.advantage for x in s]
    p = cfg.precision
    ctl = ToleranceController(p.old_logprobs, p.audit_fraction, p.tolerance, p.recheck_interval)
    _, _, m = phases.old_logprobs(cfg, ConstLearner(learner), ctl, s, 0)
    assert m[key] == pytest.approx(share)
    if correction == "mask":
        assert [x.num_trainable for x in s] == [3, 0, 3, 0]
    if correction == "mis":  # weight e > C = 2 dropped, e^(-2/3) kept
        assert [x.num_trainable for x in s] == [3, 0, 3, 3]
        assert m["precision/masked_sequences"] == 1.0
    if correction == "icepop":  # k = e lies inside [0.5, 5]: only the e^-2 token goes
        assert [x.num_trainable for x in s] == [3, 3, 3, 2]
    if correction == "tis":
        assert s[1].advantage == pytest.approx(before[1] * 2.0)  # weight e truncated at C = 2
        assert not math.isnan(m["precision/tis_weight_mean"])
