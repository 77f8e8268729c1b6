"""Qwen3-style chat rendering and tool-call parsing for multi-turn episodes.

Implements the ChatML turn layout used by Qwen2.5/Qwen3 (`<|im_start|>role\\n...<|im_end|>\\n`)
with Hermes-style function calling: tool schemas listed in the system turn inside
`<tools></tools>`, calls emitted by the model as `<tool_call>\\n{"name": ..., "arguments": {...}}
\\n</tool_call>`, and tool results returned in a user turn, each wrapped in
`<tool_response>\\n...\\n</tool_response>`.

Only text is produced here; the episode runner tokenises environment text itself and never
re-tokenises what the model generated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChatFormat:
    """The special strings of one chat format (defaults: Qwen3)."""

    im_start: str = "<|im_start|>"
    im_end: str = "<|im_end|>"
    tool_call_start: str = "<tool_call>"
    tool_call_end: str = "</tool_call>"
    tool_response_start: str = "<tool_response>"
    tool_response_end: str = "</tool_response>"
    think_start: str = "<think>"
    think_end: str = "</think>"


QWEN3 = ChatFormat()


@dataclass
class ToolCall:
    """One parsed tool call (`id`: the call id the model wrote, if its format has one)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str | None = None


@dataclass
class ParsedAction:
    """What the model's turn contains.

    Attributes:
        content: the text outside tool-call blocks (stripped).
        tool_calls: well-formed tool calls, in order.
        errors: one message per malformed `<tool_call>` block (bad JSON, missing name, ...).
    """

    content: str
    tool_calls: list[ToolCall]
    errors: list[str]


def _tools_block(tools: list[dict[str, Any]], fmt: ChatFormat) -> str:
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
    ]
    for schema in tools:
        lines.append(json.dumps(schema, ensure_ascii=False))
    lines += [
        "</tools>",
        "",
        (
            "For each function call, return a json object with function name and arguments "
            f"within {fmt.tool_call_start}{fmt.tool_call_end} XML tags:"
        ),
        fmt.tool_call_start,
        '{"name": <function-name>, "arguments": <args-json-object>}',
        fmt.tool_call_end,
    ]
    return "\n".join(lines)


def render_tool_call(call: ToolCall, fmt: ChatFormat = QWEN3) -> str:
    """Text of one tool call as the model is expected to write it."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{fmt.tool_call_start}\n{body}\n{fmt.tool_call_end}"


def _render_one(msg: dict[str, Any], fmt: ChatFormat) -> str:
    role = msg.get("role")
    content = msg.get("content") or ""
    if role == "assistant" and msg.get("tool_calls"):
        parts = [content] if content else []
        for c in msg["tool_calls"]:
            fn = c.get("function", c)
            args = fn.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            parts.append(render_tool_call(ToolCall(fn["name"], args), fmt))
        content = "\n".join(parts)
    return f"{fmt.im_start}{role}\n{content}{fmt.im_end}\n"


def render_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    fmt: ChatFormat = QWEN3,
) -> str:
    """Render a chat (and the tool schemas) to prompt text.

    Args:
        messages: [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...].
        tools: JSON schemas `{"type": "function", "function": {...}}`; listed in the system turn.
        add_generation_prompt: end with the opening of an assistant turn.
        enable_thinking: if False, the assistant turn starts with an empty think block.
        fmt: the chat format's special strings.
    Returns:
        The prompt text.
    """
    for i, m in enumerate(messages):
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"chat message {i}: unknown role {m.get('role')!r}")
    out: list[str] = []
    rest = list(messages)
    if tools:
        sys_text = ""
        if rest and rest[0]["role"] == "system":
            sys_text = (rest.pop(0).get("content") or "") + "\n\n"
        out.append(f"{fmt.im_start}system\n{sys_text}{_tools_block(tools, fmt)}{fmt.im_end}\n")
    i = 0
    while i < len(rest):
        if rest[i]["role"] == "tool":
            j = i
            while j < len(rest) and rest[j]["role"] == "tool":
                j += 1
            out.append(render_tool_responses([m.get("content") or "" for m in rest[i:j]], fmt))
            i = j
        else:
            out.append(_render_one(rest[i], fmt))
            i += 1
    if add_generation_prompt:
        out.append(generation_prompt(enable_thinking, fmt))
    return "".join(out)


def generation_prompt(enable_thinking: bool = False, fmt: ChatFormat = QWEN3) -> str:
    """Opening of an assistant turn."""
    text = f"{fmt.im_start}assistant\n"
    if not enable_thinking:
        text += f"{fmt.think_start}\n\n{fmt.think_end}\n\n"
    return text


def render_tool_responses(contents: list[str], fmt: ChatFormat = QWEN3) -> str:
    """One user turn holding the given tool results, each in a tool-response wrapper."""
    body = "".join(
        f"\n{fmt.tool_response_start}\n{c}\n{fmt.tool_response_end}" for c in contents
    )
    return f"{fmt.im_start}user{body}{fmt.im_end}\n"


def render_observation(
    messages: list[dict[str, Any]],
    *,
    model_closed_turn: bool,
    enable_thinking: bool = False,
    fmt: ChatFormat = QWEN3,
) -> str:
    """Text appended after a model turn: close the turn if the model did not, the environment's
    messages (tool results and/or user text), then the next assistant opening.

    Args:
        messages: [{"role": "tool"|"user", "content": str}, ...].
        model_closed_turn: True if the model's last token was the end-of-turn marker.
        enable_thinking: see `render_messages`.
        fmt: the chat format's special strings.
    Returns:
        The text to tokenise and append with loss mask 0.
    """
    for i, m in enumerate(messages):
        if m.get("role") not in ("user", "tool", "system"):
            raise ValueError(f"observation message {i}: role {m.get('role')!r} not allowed")
    head = "\n" if model_closed_turn else f"{fmt.im_end}\n"
    return head + render_messages(
        messages, add_generation_prompt=True, enable_thinking=enable_thinking, fmt=fmt
    )


_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def tool_call_json(body: str) -> tuple[Any, str | None]:
    """The decoded JSON of a tool-call body, or (None, a one-line error)."""
    try:
        return json.loads(body), None
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON in tool call: {exc.msg} at position {exc.pos}"
    except RecursionError:
        return None, "tool call JSON is nested too deeply"


def tool_call_from_obj(obj: Any, arg_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | str:
    """A ToolCall from a decoded JSON object (arguments under the first of `arg_keys` present,
    as an object or a JSON string), or a one-line error."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'tool call must be a JSON object with a string "name"'
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        args, error = tool_call_json(args)
        if error:
            return f'tool call {obj["name"]!r}: arguments are not a JSON object'
    if not isinstance(args, dict):
        return f'tool call {obj["name"]!r}: arguments are not a JSON object'
    call_id = obj.get("id")
    return ToolCall(obj["name"], args, id=call_id if isinstance(call_id, str) else None)


def parse_action(text: str, fmt: ChatFormat = QWEN3) -> ParsedAction:
    """Split the model's turn text into content and tool calls.

    A block left open at the end of the text (generation stopped on the closing tag and the
    engine dropped it) is parsed too. Special end markers are removed from the content.

    Args:
        text: decoded model turn.
        fmt: the chat format's special strings.
    Returns:
        ParsedAction; never raises on malformed calls (they are listed in `errors`).
    """
    pattern = _BLOCK
    if fmt.tool_call_start != "<tool_call>" or fmt.tool_call_end != "</tool_call>":
        s, e = re.escape(fmt.tool_call_start), re.escape(fmt.tool_call_end)
        pattern = re.compile(f"{s}(.*?)(?:{e}|$)", re.DOTALL)
    calls: list[ToolCall] = []
    errors: list[str] = []
    for m in pattern.finditer(text):
        obj, error = tool_call_json(m.group(1).strip())
        got = error if error else tool_call_from_obj(obj)
        if isinstance(got, str):
            errors.append(got)
        else:
            calls.append(got)
    content = pattern.sub("", text)
    for marker in (fmt.im_end, "<|endoftext|>"):
        content = content.replace(marker, "")
    think = re.compile(f"{re.escape(fmt.think_start)}.*?{re.escape(fmt.think_end)}", re.DOTALL)
    content = think.sub("", content)
    return ParsedAction(content=content.strip(), tool_calls=calls, errors=errors)


# The built-in renderer as a Jinja chat template (Qwen3 layout, append-only): prompts and
# environment turns render to exactly the text of `render_messages` / `render_observation`.
# Unlike Qwen3's own template it never drops earlier thinking, and every assistant turn keeps
# the empty think block its generation prompt had (`enable_thinking` false, the default here).
# Shipped in the multi-turn example's tokenizer so the template path is exercised end to end.
QWEN3_CHAT_TEMPLATE = (
    "{%- set ns = namespace(skip=false) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- (messages[0].content or '') + '\\n\\n' }}{%- set ns.skip = true %}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role ' + message.role) }}"
    "{%- elif loop.first and ns.skip %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if not (enable_thinking | default(false)) %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' "
    "+ (fn.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if not (enable_thinking | default(false)) %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
