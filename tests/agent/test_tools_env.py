"""ToolSet error handling, ToolEnvironment metrics, the calculator env and the env registry."""

import asyncio

import pytest

from megatron_gspo.agent.chat import ToolCall
from megatron_gspo.agent.env import StepResult, make_env_factory, register_env, resolve_env
from megatron_gspo.agent.envs import CalculatorEnv, last_number
from megatron_gspo.agent.tools import Calculator, ToolSet


class Slow:
    name, description, parameters = "slow", "sleeps", {"type": "object"}

    async def __call__(self, arguments):
        await asyncio.sleep(5)
        return "never"


class Huge:
    name, description, parameters = "huge", "prints a lot", {"type": "object"}

    async def __call__(self, arguments):
        return "x" * 100_000


class Buggy:
    name, description, parameters = "buggy", "raises", {"type": "object"}

    async def __call__(self, arguments):
        raise RuntimeError("internal")


def run(coro):
    return asyncio.run(coro)


def test_toolset_errors_never_raise():
    ts = ToolSet([Calculator(), Slow(), Huge(), Buggy()], timeout_s=0.2, max_output_chars=50)
    r = run(ts.execute(ToolCall("nope", {})))
    assert (
        r.error == "unknown_tool" and "available tools: buggy, calculator, huge, slow" in r.content
    )
    assert run(ts.execute(ToolCall("slow", {}))).error == "timeout"
    r = run(ts.execute(ToolCall("huge", {})))
    assert r.error is None and r.truncated and "99950 more characters" in r.content
    assert len(r.content) < 120
    assert run(ts.execute(ToolCall("buggy", {}))).error == "tool_error"
    assert run(ts.execute(ToolCall("calculator", {"x": "1"}))).error == "bad_arguments"
    r = run(ts.execute(ToolCall("calculator", {"expression": "1/0"})))
    assert r.error == "tool_error" and "division by zero" in r.content
    with pytest.raises(ValueError, match="duplicate tool name"):
        ToolSet([Calculator(), Calculator()])


def test_calculator_env_step_metrics_and_reward():
    env = CalculatorEnv(tool_call_reward=0.1, tool_error_reward=-0.1)
    row = {"prompt": "What is 6*7?", "label": "42"}
    first = run(env.reset(row))
    assert first[0]["role"] == "system" and first[1] == {"role": "user", "content": "What is 6*7?"}
    assert env.tool_schemas()[0]["function"]["name"] == "calculator"
    res = run(
        env.step(
            '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
        )
    )
    assert isinstance(res, StepResult) and not res.done and res.reward == pytest.approx(0.1)
    assert res.observation == [{"role": "tool", "content": "42"}] and res.info["tool_calls"] == 1
    res = run(
        env.step(
            '<tool_call>{bad</tool_call><tool_call>{"name": "web", "arguments": {}}</tool_call>'
        )
    )
    assert res.reward == pytest.approx(-0.1) and len(res.observation) == 2
    assert res.info["tool_errors/invalid_call"] == 1 and res.info["tool_errors/unknown_tool"] == 1
    assert res.observation[0]["content"].startswith("Error: invalid JSON")
    res = run(env.step("The answer is 42.<|im_end|>"))
    assert res.done and res.reward == 1.0 and res.info["correct"] == 1
    assert run(env.step("It is 41")).reward == 0.0
    assert last_number("costs 1,234.5 dollars") == 1234.5 and last_number("none") is None


def test_registry():
    assert resolve_env("calculator") is CalculatorEnv
    assert resolve_env("megatron_gspo.agent.envs:CalculatorEnv") is CalculatorEnv
    env = make_env_factory("calculator", {"python_tool": True})()
    assert sorted(env.tools.tools) == ["calculator", "python"]
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        resolve_env("nope")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_env("no_such_mod_xyz:Env")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        resolve_env("megatron_gspo.agent.envs:Missing")
    with pytest.raises(ValueError, match="already registered"):
        register_env("calculator")(type("Other", (), {}))


def test_calculator_demonstration_sits_between_system_and_question():
    demo = [{"role": "user", "content": "3 boxes of 4 and 2 more?"},
            {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": '
             '{"expression": "3*4+2"}}</tool_call>'},
            {"role": "tool", "content": "14"}, {"role": "assistant", "content": "14"}]
    env = CalculatorEnv(system_prompt="S", demonstration=demo)
    msgs = env.first_messages({"prompt": "Q?", "label": "1"})
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant",
                                         "user"]
    assert msgs[0]["content"] == "S" and msgs[1:5] == demo and msgs[5]["content"] == "Q?"
    own = env.first_messages({"prompt": [{"role": "system", "content": "mine"},
                                         {"role": "user", "content": "Q?"}], "label": "1"})
    assert [m["content"] for m in own][:2] == ["mine", demo[0]["content"]] and len(own) == 6
    msgs[1]["content"] = "changed"  # each episode gets its own copies
    assert env.first_messages({"prompt": "Q?", "label": "1"})[1] == demo[0]
    assert CalculatorEnv().first_messages({"prompt": "Q?"})[1:] == [
        {"role": "user", "content": "Q?"}]
    with pytest.raises(ValueError, match="demonstration message 1 needs"):
        CalculatorEnv(demonstration=[demo[0], {"role": "tool"}])
