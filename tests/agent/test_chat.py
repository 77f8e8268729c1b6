"""Qwen3-style chat rendering and tool-call parsing."""

import pytest

from megatron_gspo.agent.chat import (
    ToolCall,
    parse_action,
    render_messages,
    render_observation,
    render_tool_call,
)

SCHEMA = {
    "type": "function",
    "function": {"name": "calculator", "description": "d", "parameters": {"type": "object"}},
}


def test_render_with_tools_and_history():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}
            ],
        },
        {"role": "tool", "content": "4"},
        {"role": "tool", "content": "ok"},
    ]
    text = render_messages(msgs, [SCHEMA], enable_thinking=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in text
    assert "<|im_start|>user\n2+2?<|im_end|>\n" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "2+2"}}\n</tool_call><|im_end|>\n'
    ) in text
    # consecutive tool messages share one user turn
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\nok\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_generation_prompt_thinking_off_and_bad_role():
    text = render_messages([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        render_messages([{"role": "robot", "content": "x"}])


def test_observation_closes_open_turn():
    obs = [{"role": "tool", "content": "7"}]
    a = render_observation(obs, model_closed_turn=False, enable_thinking=True)
    b = render_observation(obs, model_closed_turn=True, enable_thinking=True)
    assert a.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response>")
    assert b.startswith("\n<|im_start|>user\n") and b.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="role 'assistant' not allowed"):
        render_observation([{"role": "assistant", "content": "x"}], model_closed_turn=True)


def test_parse_action_cases():
    ok = parse_action(
        'Let me compute.<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "1+2"}}\n</tool_call>'
    )
    assert ok.tool_calls == [ToolCall("calculator", {"expression": "1+2"})]
    assert ok.errors == [] and ok.content == "Let me compute."
    s = parse_action(
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "b"}'
    )  # string arguments; unterminated last block
    assert [c.name for c in s.tool_calls] == ["a", "b"] and s.tool_calls[0].arguments == {"x": 1}
    bad = parse_action(
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "c", "arguments": 3}</tool_call>'
    )
    assert bad.tool_calls == [] and len(bad.errors) == 3
    assert "invalid JSON" in bad.errors[0] and '"name"' in bad.errors[1]
    final = parse_action("<think>hmm</think>The answer is 42.<|im_end|>")
    assert final.content == "The answer is 42." and not final.tool_calls and not final.errors


def test_render_tool_call_roundtrip():
    call = ToolCall("calculator", {"expression": "3*4"})
    assert parse_action(render_tool_call(call)).tool_calls == [call]
