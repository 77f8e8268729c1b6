"""Config loading: strict keys and types, overrides, cross-field checks, round trip."""

import pytest
import yaml

from megatron_gspo.config import Config, ConfigError, describe, load_config, save_config

VALID = """
model:
  path: /models/qwen3
  dtype: bfloat16
parallel:
  tensor: 2
  pipeline: 2
  sequence_parallel: true
algorithm:
  loss: gspo
  eps_low: 0.0003
  eps_high: 0.0004
rollout:
  group_size: 4
  stop_token_ids: [1, 2]
precision:
  old_logprobs: auto
train:
  max_steps: 10
  seed: 7
"""


def _write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_valid_yaml_loads(tmp_path):
    cfg = load_config(_write(tmp_path, VALID))
    assert cfg.parallel.tensor == 2 and cfg.parallel.sequence_parallel is True
    assert cfg.algorithm.clip_range() == (3e-4, 4e-4)
    assert cfg.rollout.stop_token_ids == [1, 2]
    assert cfg.train.max_steps == 10 and cfg.precision.old_logprobs == "auto"
    assert isinstance(cfg.algorithm.eps_low, float)


@pytest.mark.parametrize(
    "text, message",
    [
        ("algorithm:\n  eps_hihg: 0.1\n", "algorithm.eps_hihg: unknown key"),
        ("algorithm:\n  eps_high: x\n", "algorithm.eps_high: expected float > 0, got 'x'"),
        ("algorithm:\n  eps_high: -1.0\n", "algorithm.eps_high: expected float > 0, got -1.0"),
        ("parallel:\n  tensor: 1.5\n", "parallel.tensor: expected int >= 1, got 1.5"),
        ("parallel:\n  tensor: true\n", "parallel.tensor: expected int"),
        ("train:\n  resume: sometimes\n", "train.resume: expected one of 'auto', 'never'"),
        ("rollout:\n  stop_token_ids: [1, b]\n", "rollout.stop_token_ids[1]: expected int"),
        ("trian:\n  max_steps: 1\n", "trian: unknown key"),
        ("train: 5\n", "train: expected a mapping"),
        ("logging:\n  tensorboard: 'yes'\n", "logging.tensorboard: expected bool"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("a: [\n", "invalid YAML"),
    ],
)
def test_bad_values_name_the_path(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_overrides_apply_and_bad_overrides_fail(tmp_path):
    p = _write(tmp_path, VALID)
    cfg = load_config(p, ["train.max_steps=3", "algorithm.eps_high=5e-4",
                          "rollout.engine=sglang", "rollout.server_urls=[http://a:1, http://b:2]",
                          "model.path=null"])
    assert cfg.train.max_steps == 3 and cfg.algorithm.eps_high == 5e-4
    assert cfg.rollout.server_urls == ["http://a:1", "http://b:2"]
    assert cfg.model.path is None
    for bad, msg in [("train.max_stepz=3", "train.max_stepz: unknown key"),
                     ("train.max_steps=abc", "train.max_steps: expected int"),
                     ("train.max_steps.x=1", "train.max_steps.x: train.max_steps is not a section"),
                     ("max_steps", "expected key.sub=value")]:
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")
                           if "unknown" in msg else None) as e:
            load_config(p, [bad])
        assert msg in str(e.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        load_config(None, ["parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError, match="GRPO-sized"):
        load_config(None, ["algorithm.eps_high=0.28"])
    assert load_config(None, ["algorithm.loss=grpo"]).algorithm.clip_range() == (0.2, 0.28)
    with pytest.raises(ConfigError, match="agent.advantage"):
        load_config(None, ["agent.advantage=turn"])
    with pytest.raises(ConfigError, match="virtual_pipeline"):
        load_config(None, ["parallel.virtual_pipeline=2"])


def test_write_out_read_back_is_identity(tmp_path):
    cfg = load_config(_write(tmp_path, VALID), ["reward.kwargs={tol: 0.01}"])
    out = tmp_path / "resolved.yaml"
    save_config(cfg, out)
    again = load_config(out)
    assert again == cfg
    assert yaml.safe_load(out.read_text())["parallel"]["tensor"] == 2


def test_every_field_has_a_doc():
    rows = describe(Config)
    assert len(rows) > 60
    missing = [name for name, _, _, doc in rows if not doc.strip()]
    assert not missing, missing
    names = {r[0] for r in rows}
    for required in ("train.max_steps", "train.seed", "train.resume", "checkpoint.interval",
                     "parallel.tensor", "parallel.pipeline", "parallel.expert",
                     "precision.old_logprobs"):
        assert required in names


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/x.yaml")
