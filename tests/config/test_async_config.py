"""The asynchronous-rollout settings: each one set while it is unused is a one-line error."""

import pytest

from megatron_gspo.config import ConfigError, config_from_dict, describe, Config


@pytest.mark.parametrize("key,value", [("max_staleness", 2), ("update_in_flight", "abort"),
                                       ("chunk_tokens", 8)])
def test_async_fields_unused_in_sync_mode(key, value):
    with pytest.raises(ConfigError, match=rf"^rollout\.{key}: set while rollout\.mode is 'sync'"):
        config_from_dict({"rollout": {key: value}})
    cfg = config_from_dict({"rollout": {"mode": "async", key: value}})
    assert getattr(cfg.rollout, key) == value


def test_async_refuses_colocated_sglang_and_over_sampling():
    with pytest.raises(ConfigError, match=r"^rollout\.mode: 'async' needs the SGLang servers"):
        config_from_dict({"model": {"path": "m"}, "rollout": {"mode": "async", "engine": "sglang"}})
    config_from_dict({"model": {"path": "m"},
                      "rollout": {"mode": "async", "engine": "sglang", "colocate": False}})
    with pytest.raises(ConfigError, match=r"^rollout\.over_sample: not used"):
        config_from_dict({"rollout": {"mode": "async", "over_sample": 2.0}})
    with pytest.raises(ConfigError, match="rollout.mode: expected one of"):
        config_from_dict({"rollout": {"mode": "fast"}})


def test_async_fields_documented():
    docs = {name: doc for name, _t, _d, doc in describe(Config)}
    for key in ("mode", "max_staleness", "update_in_flight", "chunk_tokens"):
        assert docs[f"rollout.{key}"]
