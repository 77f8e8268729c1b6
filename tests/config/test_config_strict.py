"""The config loader refuses what YAML 1.1 would silently misread, and non-UTF-8 files, with
one-line errors; `data.label_key` may be null (unlabeled datasets)."""

import pytest

from megatron_gspo.cli import main
from megatron_gspo.config import ConfigError, load_config


def _write(tmp_path, content: bytes | str):
    p = tmp_path / "c.yaml"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p


def test_duplicate_key_is_an_error(tmp_path):
    p = _write(tmp_path, "train:\n  max_steps: 3\n  max_steps: 5\n")
    with pytest.raises(ConfigError, match=r"line 3: duplicate key 'max_steps'"):
        load_config(p)
    p = _write(tmp_path, "train:\n  seed: 1\ntrain:\n  max_steps: 5\n")
    with pytest.raises(ConfigError, match="duplicate key 'train'"):
        load_config(p)


def test_leading_zero_and_base60_numbers_are_errors(tmp_path):
    p = _write(tmp_path, "train:\n  seed: 010\n")
    with pytest.raises(ConfigError, match="'010' has a leading zero"):
        load_config(p)
    with pytest.raises(ConfigError, match="'010' has a leading zero"):
        load_config(None, ["train.seed=010"])
    p = _write(tmp_path, "train:\n  seed: 1:30\n")
    with pytest.raises(ConfigError, match="base-60"):
        load_config(p)
    # what stays allowed
    assert load_config(_write(tmp_path, "train:\n  seed: 10\n")).train.seed == 10
    assert load_config(None, ["train.seed=0"]).train.seed == 0
    assert load_config(None, ["optimizer.lr=0.001"]).optimizer.lr == 0.001
    assert load_config(None, ["data.system_prompt='010'"]).data.system_prompt == "010"


def test_non_utf8_config_is_a_one_line_error(tmp_path, capsys):
    p = _write(tmp_path, b"train:\n  max_steps: 3\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"line 3: not UTF-8 text \(byte 0xe9 at offset 27\)"):
        load_config(p)
    assert main(["config", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not UTF-8" in err[0]


def test_label_key_may_be_null(tmp_path):
    assert load_config(None, ["data.label_key=null"]).data.label_key is None
    p = _write(tmp_path, "data:\n  label_key: null\n")
    assert load_config(p).data.label_key is None


@pytest.mark.parametrize("override,match", [
    ("train.seed=-1", r"train.seed: expected int >= 0 and <= 2147483647, got -1"),
    ("train.seed=100000000000000000000",
     r"train.seed: expected int >= 0 and <= 2147483647, got 1000"),
    ("rollout.group_size=1", r"rollout.group_size: expected int >= 2"),
])
def test_values_that_would_fail_or_learn_nothing_later(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])
