"""How many passes over the batch steps 3-4 of the loop make (reference log-probs, advantages,
pi_old), with a learner that records its forward passes: with KL on and the learner's pi_old
needed (recompute, audit, no engine log-probs) ONE paired pass gives both; with pi_old from the
rollout the reference forward is the only pass; KL off runs no reference pass."""

from __future__ import annotations

import math

import pytest

from megatron_gspo.loop import phases
from megatron_gspo.algo.precision import ToleranceController
from megatron_gspo.config import config_from_dict
from megatron_gspo.data.sample import Sample

POLICY, REF, ENGINE = -1.0, -1.5, -1.1  # per-token log-probs of the three sources


class RecordingLearner:
    """Learner stand-in: constant log-probs per source; records every pass over the batch."""

    def __init__(self):
        self.passes: list[str] = []

    def forward_logprobs(self, samples, *, reference=False, **_):
        self.passes.append("reference" if reference else "policy")
        v = REF if reference else POLICY
        return [[v] * len(s.response_ids) for s in samples]

    def forward_logprobs_with_reference(self, samples, **_):
        self.passes.append("policy+reference")
        return ([[POLICY] * len(s.response_ids) for s in samples],
                [[REF] * len(s.response_ids) for s in samples])


def _samples(engine: bool) -> list[Sample]:
    return [Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], reward=float(i % 2), index=i,
                   group_index=i // 2, rollout_logprobs=[ENGINE] * 3 if engine else None)
            for i in range(4)]


def _steps_3_4(overrides: list[str], step: int, engine: bool = True):
    """The loop's steps 3 (reference + advantages) and 4 (pi_old), as `loop/train.py` runs them."""
    cfg = config_from_dict({}, ["rollout.group_size=2", "train.prompts_per_step=2", *overrides])
    p = cfg.precision
    controller = ToleranceController(p.old_logprobs, p.audit_fraction, p.tolerance,
                                     p.recheck_interval)
    learner, samples = RecordingLearner(), _samples(engine)
    need = phases.learner_logprobs_needed(cfg, controller, samples, step)
    ref, learner_lps, kl_m = phases.reference_logprobs(cfg, learner, samples, need)
    phases.fill_advantages(cfg, samples)
    old, source, pm = phases.old_logprobs(cfg, learner, controller, samples, step, learner_lps)
    return learner.passes, ref, old, source, {**kl_m, **pm}


KL = ["algorithm.kl_coef=0.05"]


def _k3(logp: float, ref: float) -> float:
    d = logp - ref
    return math.exp(-d) - 1 + d


def test_recompute_with_kl_is_one_paired_pass():
    passes, ref, old, source, m = _steps_3_4(KL + ["precision.old_logprobs=recompute"], 3)
    assert passes == ["policy+reference"]
    assert source == "recompute" and old[0] == [POLICY] * 3 and ref[0] == [REF] * 3
    assert m["precision/audited"] == 1.0  # the audit used the paired pass's policy values
    assert m["kl/mean"] == pytest.approx(_k3(ENGINE, REF), rel=1e-5)  # the sampling policy's
    assert "time/reference_logprobs" in m


def test_auto_audit_step_is_one_paired_pass_and_other_steps_only_the_reference():
    audited = _steps_3_4(KL + ["precision.old_logprobs=auto", "precision.audit_fraction=0.25"], 0)
    assert audited[0] == ["policy+reference"] and audited[4]["precision/audited"] == 1.0
    reused = _steps_3_4(KL + ["precision.old_logprobs=auto", "precision.audit_fraction=0.25"], 1)
    assert reused[0] == ["reference"] and reused[3] == "rollout" and reused[2] is None


def test_rollout_pi_old_with_kl_runs_only_the_reference():
    passes, ref, old, source, _ = _steps_3_4(KL + ["precision.old_logprobs=rollout",
                                                   "precision.audit_fraction=0"], 2)
    assert passes == ["reference"] and old is None and source == "rollout"


def test_no_engine_logprobs_one_pass_gives_kl_and_pi_old():
    passes, _, old, source, m = _steps_3_4(KL + ["precision.old_logprobs=auto"], 1, engine=False)
    assert passes == ["policy+reference"] and source == "recompute"
    assert old[0] == [POLICY] * 3
    # kl/mean is measured on the sampling policy: here the learner's own log-probs
    assert m["kl/mean"] == pytest.approx(_k3(POLICY, REF), rel=1e-5)


def test_kl_off_builds_no_reference_pass():
    passes, ref, old, _, m = _steps_3_4(["precision.old_logprobs=recompute"], 0)
    assert passes == ["policy"] and ref is None and "kl/mean" not in m
