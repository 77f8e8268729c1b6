"""User reward code that does not load is a one-line RewardError (not a traceback); a reward
value must be a real number: strings and booleans are refused, numpy / torch scalars pass."""

import sys

import numpy as np
import pytest
import torch

from megatron_gspo.data.sample import Sample
from megatron_gspo.rewards import RewardError, get_reward_fn, score_samples


def _file(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_reward_file_with_syntax_error(tmp_path):
    p = _file(tmp_path, "bad_syntax.py", "def reward(t, l, m):\n    return (1\n")
    with pytest.raises(RewardError, match=r"bad_syntax.py:reward.*SyntaxError.*line 2") as e:
        get_reward_fn(f"{p}:reward")
    assert "\n" not in str(e.value)


def test_reward_file_with_import_error_or_raising_at_import(tmp_path):
    p = _file(tmp_path, "bad_import.py",
              "import no_such_module_xyz\ndef reward(t, l, m): return 0\n")
    with pytest.raises(RewardError, match="ModuleNotFoundError: No module named 'no_such_module"):
        get_reward_fn(f"{p}:reward")
    p = _file(tmp_path, "bad_top.py", "x = 1 / 0\ndef reward(t, l, m): return 0\n")
    with pytest.raises(RewardError, match="ZeroDivisionError"):
        get_reward_fn(f"{p}:reward")


def test_reward_module_with_syntax_error(tmp_path, monkeypatch):
    _file(tmp_path, "gspo_bad_mod_xyz.py", "def reward(t, l, m):\n    return (1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="gspo_bad_mod_xyz.*SyntaxError"):
        get_reward_fn("gspo_bad_mod_xyz:reward")
    sys.modules.pop("gspo_bad_mod_xyz", None)


def _sample():
    return Sample(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], label="x")


@pytest.mark.parametrize("value", ["0.5", True, np.bool_(True), None, [0.5],
                                   torch.tensor([1.0, 2.0])])
def test_non_numeric_reward_values_are_refused(value):
    with pytest.raises(RewardError, match="expected a real number"):
        score_samples([_sample()], lambda text, label, meta: value, lambda ids: "r")


@pytest.mark.parametrize("value,want", [(1, 1.0), (0.25, 0.25), (np.float32(0.5), 0.5),
                                        (np.int64(2), 2.0), (torch.tensor(0.75), 0.75)])
def test_numeric_reward_values_pass(value, want):
    s = _sample()
    assert score_samples([s], lambda text, label, meta: value, lambda ids: "r") == [want]
    assert s.reward == want and type(s.reward) is float
