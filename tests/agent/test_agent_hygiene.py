"""Agent input hygiene: deeply nested tool-call JSON is a tool error (not RecursionError);
non-finite or non-numeric environment rewards end only their episode and are counted;
non-numeric calculator labels are bad rows before training, and counted when they slip
through; environment files that do not import are one-line errors."""

import math

import pytest

from megatron_gspo.loop import build
from megatron_gspo.agent.chat import parse_action
from megatron_gspo.agent.env import StepResult, resolve_env
from megatron_gspo.agent.envs import CalculatorEnv
from megatron_gspo.agent.runner import episode_metrics
from megatron_gspo.config import load_config
from megatron_gspo.data.datasets import DatasetError
from tests.agent.test_runner import GOOD, ROWS, make_runner, script_from
from tests.agent.agent_helpers import ScriptedEngine
from tests.data.test_datasets import TOK as CHAR_TOK


def test_parse_action_survives_deep_nesting():
    deep = "[" * 200_000 + "]" * 200_000
    parsed = parse_action(f"<tool_call>{deep}</tool_call>")
    assert parsed.tool_calls == [] and parsed.errors == ["tool call JSON is nested too deeply"]
    args = '"' + "[" * 200_000 + "]" * 200_000 + '"'
    parsed = parse_action(f'<tool_call>{{"name": "calculator", "arguments": {args}}}</tool_call>')
    assert parsed.tool_calls == [] and len(parsed.errors) == 1


class _BadRewardEnv(CalculatorEnv):
    def __init__(self, value):
        super().__init__(tool_call_reward=0.25)
        self.value = value

    async def step(self, action):
        res = await super().step(action)
        return StepResult(res.observation, self.value if res.done else res.reward, res.done,
                          res.info)


@pytest.mark.parametrize("value", [math.nan, math.inf, "0.5", True, None])
def test_bad_environment_reward_ends_the_episode_and_is_counted(value):
    runner = make_runner(ScriptedEngine(script_from(GOOD)), lambda: _BadRewardEnv(value))
    samples = runner.run_batch_sync(ROWS, n_per_prompt=1)
    for s in samples:
        assert s.metadata["stop_reason"] == "env_error"
        assert "expected a finite number" in s.metadata["env_error"]
        assert math.isfinite(s.reward) and s.turn_rewards == [0.25, 0.0]
    assert episode_metrics(samples)["agent/env_errors"] == 1.0


def test_calculator_label_check_and_counted_failures():
    assert CalculatorEnv.check_label("1,234") == 1234.0 and CalculatorEnv.check_label(7) == 7.0
    for bad in ("seven", None, True, "nan", [1]):
        with pytest.raises(ValueError, match="calculator environment"):
            CalculatorEnv.check_label(bad)
    rows = [{"prompt": "What is 12*3?", "label": "thirty-six"}]
    samples = make_runner(ScriptedEngine(script_from(GOOD))).run_batch_sync(rows)
    assert samples[0].metadata["stop_reason"] == "env_error"
    assert episode_metrics(samples)["agent/env_errors"] == 1.0


def _agent_cfg(path, *extra):
    return load_config(None, ["agent.enabled=true", "data.apply_chat_template=false",
                              f"data.train_path={path}", *extra])


def test_non_numeric_labels_are_bad_rows_before_training(tmp_path, monkeypatch):
    from megatron_gspo.agent import loop as agent_loop

    # CHAR_TOK renders no chat: the opening-prompt length check (tests/loop) is not this test's
    monkeypatch.setattr(agent_loop, "check_opening_prompts", lambda *a, **k: None)
    p = tmp_path / "rows.jsonl"
    p.write_text('{"prompt": "What is 1+1?", "answer": "2"}\n'
                 '{"prompt": "What is 1+2?", "answer": "three"}\n'
                 '{"prompt": "What is 2+2?", "answer": 4}\n')
    with pytest.raises(DatasetError, match=r"rows.jsonl row 1: label 'three': calculator "
                                           r"environment: label is not a number"):
        build.prompt_stream(_agent_cfg(p), CHAR_TOK)
    stream = build.prompt_stream(_agent_cfg(p, "data.skip_bad_rows=true"), CHAR_TOK)
    assert [it.label for it in stream.dataset.items] == ["2", 4]
    assert stream.dataset.num_skipped == 1


def test_environment_file_that_does_not_import(tmp_path):
    f = tmp_path / "bad_env.py"
    f.write_text("class Env:\n    def __init__(self):\n        return (\n")
    with pytest.raises(ValueError, match=r"cannot import module .*SyntaxError") as e:
        resolve_env(f"{f}:Env")
    assert "\n" not in str(e.value)
