"""The GSPO family in the config: every loss and correction is selectable, a setting the chosen
loss / correction / reward option would ignore is an error naming it, the KL / entropy terms and
the loss knobs reach the learner's LossSettings for every loss, and the new fields are
documented like the others."""

from __future__ import annotations

import types

import pytest

from megatron_gspo.config import LOSSES, Config, ConfigError, config_from_dict, describe


def _cfg(**sections):
    return config_from_dict(sections)


@pytest.mark.parametrize("loss, clip", [("sapo", (None, None)), ("cispo", (1.0, 0.28)),
                                        ("gmpo", (0.4, 0.4)), ("grpo", (0.2, 0.28))])
def test_each_loss_is_selectable_with_its_paper_defaults(loss, clip):
    assert _cfg(algorithm={"loss": loss}).algorithm.clip_range() == clip


@pytest.mark.parametrize("sections, field", [
    ({"algorithm": {"loss": "sapo", "eps_high": 0.3}}, "algorithm.eps_high"),
    ({"algorithm": {"loss": "gspo", "sapo_tau_neg": 2.0}}, "algorithm.sapo_tau_neg"),
    ({"algorithm": {"loss": "cispo", "sapo_tau_pos": 2.0}}, "algorithm.sapo_tau_pos"),
    ({"algorithm": {"loss": "sapo", "grpo_aggregation": "token-mean"}},
     "algorithm.grpo_aggregation"),
    ({"precision": {"correction": "tis", "icepop_high": 3.0}}, "precision.icepop_high"),
    ({"precision": {"correction": "icepop", "tis_cap": 3.0}}, "precision.tis_cap"),
    ({"precision": {"correction": "mis", "mask_bound": 0.1}}, "precision.mask_bound"),
    ({"reward": {"overlong_penalty": 0.5}}, "reward.overlong_penalty"),
    ({"reward": {"overlong_buffer": 600}}, "reward.overlong_buffer"),
    ({"agent": {"enabled": True}, "reward": {"overlong_filter": True}},
     "reward.overlong_filter"),
    ({"algorithm": {"loss": "gmpo"}, "agent": {"enabled": True, "advantage": "turn"}},
     "agent.advantage"),
    ({"algorithm": {"loss": "cispo", "eps_low": 1.5}}, "algorithm.eps_low"),
])
def test_a_setting_the_choice_would_ignore_is_an_error_naming_it(sections, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _cfg(**sections)


def test_the_settings_each_option_uses_are_accepted():
    _cfg(algorithm={"loss": "sapo", "sapo_tau_pos": 0.9, "sapo_tau_neg": 1.2})
    _cfg(algorithm={"loss": "cispo", "eps_high": 4.0})
    _cfg(algorithm={"loss": "grpo", "grpo_aggregation": "seq-mean-token-sum-norm",
                    "advantage_scale": "none"})
    _cfg(precision={"correction": "icepop", "icepop_low": 0.4, "icepop_high": 4.0})
    _cfg(precision={"correction": "mis", "tis_cap": 3.0, "offpolicy_mask_delta": 1e-3})
    _cfg(reward={"overlong_filter": True, "overlong_buffer": 100, "overlong_penalty": 0.5})
    for loss in ("sapo", "cispo", "grpo", "gspo_token"):  # per-token (turn-level) advantages
        _cfg(algorithm={"loss": loss}, agent={"enabled": True, "advantage": "turn"})


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_gets_its_knobs_kl_and_entropy_in_the_learner(loss, monkeypatch):
    """slime #397 shipped a KL term some losses never received: here the config's kl_coef,
    entropy_coef and loss knobs must reach LossSettings whatever the loss."""
    from megatron_gspo.loop import build
    from megatron_gspo.megatron import learner as learner_mod

    seen = {}
    built = types.SimpleNamespace()  # build.learner attaches the resume check and sources
    monkeypatch.setattr(learner_mod, "Learner", lambda *a, **k: seen.update(k) or built)
    extra = {"sapo_tau_neg": 1.3} if loss == "sapo" else {}
    cfg = _cfg(algorithm={"loss": loss, "kl_coef": 0.02, "entropy_coef": 0.003, **extra},
               precision={"offpolicy_mask_delta": 0.05})
    assert build.learner(cfg, {"pad_token_id": 0}) is built
    s = seen["loss"]
    assert (s.kind, s.kl_coef, s.entropy_coef, s.offpolicy_mask_delta) == (loss, 0.02, 0.003,
                                                                           0.05)
    assert seen["reference"] is True
    assert s.norm_length == cfg.rollout.max_new_tokens
    if loss == "sapo":
        assert (s.tau_pos, s.tau_neg) == (1.0, 1.3)
    else:
        assert (s.eps_low, s.eps_high) == cfg.algorithm.clip_range()


@pytest.mark.parametrize("loss, level", [("gspo", "sequence"), ("gmpo", "sequence"),
                                         ("grpo", "token"), ("sapo", "token"),
                                         ("cispo", "token")])
def test_the_precision_audit_uses_each_loss_level_and_ratio_space_band(loss, level):
    lo, hi, lv = _cfg(algorithm={"loss": loss}).algorithm.audit_range()
    assert lv == level and 0 < lo <= 1 and hi > 0
    if loss == "gmpo":  # log-space 0.4 -> ratio band (e^-0.4, e^0.4)
        assert (lo, hi) == pytest.approx((1 - 2.718281828 ** -0.4, 2.718281828 ** 0.4 - 1))


def test_new_fields_are_documented():
    rows = {name: doc for name, _, _, doc in describe(Config)}
    for name in ("algorithm.sapo_tau_pos", "algorithm.sapo_tau_neg", "precision.icepop_low",
                 "precision.icepop_high", "precision.offpolicy_mask_delta",
                 "reward.overlong_filter", "reward.overlong_buffer", "reward.overlong_penalty"):
        assert len(rows[name]) > 20, name
    assert "sapo" in rows["algorithm.loss"] and "mis" in rows["precision.correction"]
