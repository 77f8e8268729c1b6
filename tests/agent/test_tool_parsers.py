"""Tool-call parsers (agent.tool_parser): hermes, llama3_json, mistral and module:function."""

from __future__ import annotations

import asyncio

import pytest

from megatron_gspo.agent import CalculatorEnv, resolve_tool_parser
from megatron_gspo.agent.chat import ParsedAction, ToolCall
from megatron_gspo.agent.tool_parsers import parse_llama3_json, parse_mistral


def test_hermes_is_the_qwen3_format_and_stops_on_its_closing_tag():
    p = resolve_tool_parser("hermes")
    assert p.call_end == "</tool_call>"
    out = p.parse('ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}'
                  "\n</tool_call>")
    assert out.tool_calls == [ToolCall("calculator", {"expression": "1+1"})]
    assert out.content == "ok" and not out.errors


def test_llama3_json_calls_and_plain_answers():
    out = parse_llama3_json('{"name": "calculator", "parameters": {"expression": "6*7"}}'
                            "<|eot_id|>")
    assert out.tool_calls == [ToolCall("calculator", {"expression": "6*7"})]
    assert out.content == "" and not out.errors
    out = parse_llama3_json('<|python_tag|>{"name": "a", "parameters": {}}; '
                            '{"name": "b", "arguments": "{\\"x\\": 1}"}<|eom_id|>')
    assert [c.name for c in out.tool_calls] == ["a", "b"] and out.tool_calls[1].arguments == {
        "x": 1}
    out = parse_llama3_json("The answer is 42.<|eot_id|>")
    assert out.content == "The answer is 42." and out.tool_calls == [] and not out.errors
    out = parse_llama3_json('{"name": "calculator", "parameters": {"expression": ')
    assert out.tool_calls == [] and out.errors[0].startswith("invalid JSON in tool call")
    out = parse_llama3_json('{"parameters": {}}')
    assert out.errors == ['tool call must be a JSON object with a string "name"']
    out = parse_llama3_json('{"name": "a", "parameters": [1]}')
    assert out.errors == ["tool call 'a': arguments are not a JSON object"]


def test_mistral_json_list_with_ids_and_args_form():
    out = parse_mistral('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": '
                        '"6*7"}, "id": "abc123xyz"}, {"name": "b", "arguments": {}}]</s>')
    assert out.tool_calls == [ToolCall("calculator", {"expression": "6*7"}, id="abc123xyz"),
                              ToolCall("b", {})]
    out = parse_mistral('Let me compute.[TOOL_CALLS]calculator[ARGS]{"expression": "2+2"}</s>')
    assert out.content == "Let me compute."
    assert out.tool_calls == [ToolCall("calculator", {"expression": "2+2"})]
    out = parse_mistral(" 42</s>")
    assert out.content == "42" and out.tool_calls == []
    out = parse_mistral("[TOOL_CALLS] [{bad")
    assert out.tool_calls == [] and out.errors[0].startswith("invalid JSON in tool call")
    out = parse_mistral("[TOOL_CALLS] hello")
    assert out.errors == ["tool call must be a JSON list after [TOOL_CALLS]"]


def test_module_function_parser_and_its_errors(tmp_path):
    f = tmp_path / "my_parser.py"
    f.write_text(
        "from megatron_gspo.agent.chat import ParsedAction, ToolCall\n"
        "def parse(text):\n"
        "    name, _, expr = text.partition('=')\n"
        "    if not expr:\n"
        "        return ParsedAction(text, [], [])\n"
        "    return ParsedAction('', [ToolCall(name.strip(), {'expression': expr})], [])\n"
        "def wrong(text):\n"
        "    return [text]\n")
    p = resolve_tool_parser(f"{f}:parse")
    assert p.parse("calculator=6*7").tool_calls == [ToolCall("calculator", {"expression": "6*7"})]
    with pytest.raises(TypeError, match="returned list, expected ParsedAction"):
        resolve_tool_parser(f"{f}:wrong").parse("x")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve_tool_parser(f"{f}:nope")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_mod_xyz'"):
        resolve_tool_parser("no_such_mod_xyz:parse")
    with pytest.raises(ValueError, match="unknown tool parser 'qwen'"):
        resolve_tool_parser("qwen")


def test_tool_environment_uses_the_parser_it_is_given():
    env = CalculatorEnv(system_prompt=None)
    env.tool_parser = parse_mistral
    asyncio.run(env.reset({"prompt": "q", "label": "42"}))
    res = asyncio.run(env.step('[TOOL_CALLS] [{"name": "calculator", "arguments": '
                               '{"expression": "6*7"}, "id": "abc123xyz"}]'))
    assert not res.done
    assert res.observation == [{"role": "tool", "content": "42", "tool_call_id": "abc123xyz"}]
    env.tool_parser = lambda text: ParsedAction("41", [], [])
    assert asyncio.run(env.step("anything")).reward == 0.0
