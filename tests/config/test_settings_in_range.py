"""Settings that would overflow inside the math, never act, or never connect are one-line
config errors naming the field (issue 43, items 8, 9, 11 and 15)."""

import math

import pytest

from megatron_gspo.config import Config, ConfigError, config_from_dict
from megatron_gspo.config.ranges import url_problem


def _refused(overrides, field):
    with pytest.raises(ConfigError) as e:
        config_from_dict({}, overrides)
    msg = str(e.value)
    assert msg.startswith(field + ":") and "\n" not in msg, msg
    return msg


# item 8: a correction that can never run


@pytest.mark.parametrize("old", ["auto", "rollout"])
@pytest.mark.parametrize("corr", ["mask", "tis", "mis", "icepop"])
def test_a_correction_without_audited_steps_is_refused(old, corr):
    msg = _refused([f"precision.correction={corr}", "precision.audit_fraction=0",
                    f"precision.old_logprobs={old}"], "precision.correction")
    assert "never run" in msg and "audit_fraction" in msg


def test_a_correction_that_runs_is_accepted():
    config_from_dict({}, ["precision.correction=icepop", "precision.old_logprobs=recompute"])
    config_from_dict({}, ["precision.correction=icepop", "precision.audit_fraction=0.25"])
    config_from_dict({}, ["precision.audit_fraction=0"])  # no correction: reuse, no audit


def test_the_correction_rule_is_in_the_fields_help():
    from megatron_gspo.config import describe

    docs = {name: doc for name, _, _, doc in describe(Config)}
    assert "audited" in docs["precision.correction"]
    assert "recompute" in docs["precision.correction"]
    assert "0, 4, 8" in docs["precision.audit_fraction"]


# item 9: finite settings that overflow inside the math


def test_an_overlong_penalty_beyond_the_reward_bound_is_refused():
    _refused(["reward.overlong_buffer=4", "reward.overlong_penalty=1e308"],
             "reward.overlong_penalty")
    config_from_dict({}, ["reward.overlong_buffer=4", "reward.overlong_penalty=1e15"])


def test_the_largest_overlong_penalty_keeps_advantages_finite():
    import torch

    from megatron_gspo.algo.advantages import group_advantages

    # reward at the service bound, penalty at the config bound: finite in float32
    r = torch.tensor([1e15, 1e15 - 1e15, -1e15 - 1e15, 0.0])
    adv = group_advantages(r, 4)
    assert torch.isfinite(adv).all() and adv.abs().max() > 0


@pytest.mark.parametrize("cap", ["1e-300", "0.5"])
def test_a_tis_cap_below_one_is_refused(cap):
    _refused(["precision.correction=tis", f"precision.tis_cap={cap}"], "precision.tis_cap")


def test_the_smallest_tis_cap_leaves_advantages_alone_when_both_agree():
    import torch

    from megatron_gspo.algo.precision import apply_correction

    cfg = config_from_dict({}, ["precision.correction=tis", "precision.tis_cap=1"])
    adv = torch.tensor([1.0, -2.0])
    _, out, st = apply_correction(torch.zeros(2), torch.ones(2, 3), adv, mode="tis",
                                  tis_cap=cfg.precision.tis_cap)
    assert torch.equal(out, adv) and st["tis_truncated"] == 0.0


# item 11: step-0 overflows


@pytest.mark.parametrize("overrides,field", [
    (["algorithm.loss=gmpo", "algorithm.eps_low=1000", "algorithm.eps_high=1000"],
     "algorithm.eps_low"),
    (["algorithm.loss=gmpo", "algorithm.eps_high=21"], "algorithm.eps_high"),
    (["algorithm.loss=cispo", "algorithm.eps_high=1e308"], "algorithm.eps_high"),
    (["algorithm.loss=grpo", "algorithm.eps_high=1e10"], "algorithm.eps_high"),
    (["algorithm.logratio_bound=1e308"], "algorithm.logratio_bound"),
    (["rollout.temperature=1e-300"], "rollout.temperature"),
])
def test_step0_overflows_are_config_errors(overrides, field):
    _refused(overrides, field)


def test_the_largest_accepted_ranges_stay_finite_in_float32():
    import torch

    cfg = config_from_dict({}, ["algorithm.loss=cispo", "algorithm.logratio_bound=50",
                                f"algorithm.eps_high={math.expm1(50)}"])
    lo, hi = cfg.algorithm.clip_range()
    ratio = torch.exp(torch.tensor([50.0, -50.0]))
    assert torch.isfinite(ratio.clamp(max(1 - lo, 0.0), 1 + hi)).all()
    g = config_from_dict({}, ["algorithm.loss=gmpo", "algorithm.logratio_bound=50",
                              "algorithm.eps_low=50", "algorithm.eps_high=50"])
    assert all(math.isfinite(v) for v in g.algorithm.audit_range()[:2])
    config_from_dict({}, ["rollout.temperature=1e-6"])


def test_default_clip_ranges_are_accepted_for_every_loss():
    from megatron_gspo.config import LOSSES

    for loss in LOSSES:
        config_from_dict({}, [f"algorithm.loss={loss}"])


# item 15: reward.url forms that cannot work


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/score", "http:///score",
                                 "http://host:abc/score", "http://[::1/score", "http://:80/x",
                                 "http://host:0/x", "ftp://host/x"])
def test_reward_urls_that_cannot_connect_are_refused(url):
    msg = _refused([f"reward.url={url}"], "reward.url")
    assert url in msg or repr(url) in msg


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/score", "https://rewards.example/s",
                                 "http://[::1]:8000/score", "http://localhost/score?x=1"])
def test_reward_urls_that_work_are_accepted(url):
    config_from_dict({}, [f"reward.url={url}"])
    assert url_problem(url) is None
