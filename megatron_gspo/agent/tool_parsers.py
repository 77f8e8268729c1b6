"""Tool-call parsers: the model's decoded turn -> content text and tool calls.

`agent.tool_parser` names one of:
- `hermes` (default): Qwen2.5/Qwen3 and Hermes function calling, `<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>` blocks (`megatron_gspo.agent.chat.parse_action`);
- `llama3_json`: Llama 3.1/3.2 JSON tool calling, the whole turn is `{"name": ..., "parameters":
  {...}}` (optionally after `<|python_tag|>`; several calls separated by `;`), as in SGLang's and
  vLLM's `llama3` parsers;
- `mistral`: Mistral `[TOOL_CALLS]` followed by a JSON list `[{"name", "arguments", "id"}]`
  (Mistral-7B-Instruct-v0.3 and later v3 tokenizers), or the newer `[TOOL_CALLS]name[ARGS]{...}`;
- `module:function` or `path/file.py:function`: one's own parser, `function(text) ->
  ParsedAction`.

Parsers never raise on malformed model output: bad calls are listed in `ParsedAction.errors`.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from megatron_gspo.agent.chat import (ParsedAction, ToolCall, parse_action, tool_call_from_obj,
                                      tool_call_json)


@dataclass(frozen=True)
class ToolParser:
    """A named parser.

    Attributes:
        name: the `agent.tool_parser` value.
        parse: decoded model turn -> ParsedAction.
        call_end: text that closes one tool call when it is a single token the engine can stop
            on (`</tool_call>` for hermes); None when calls end with the turn itself.
    """

    name: str
    parse: Callable[[str], ParsedAction]
    call_end: str | None = None


class ToolParserError(ValueError):
    """A tool parser raised or returned something other than a ParsedAction (fails that
    episode only; the runner names the parser)."""


def checked_parser(parser: ToolParser) -> ToolParser:
    """`parser` whose exceptions and malformed results become one-line ToolParserErrors."""
    fn = parser.parse

    def parse(text: str) -> ParsedAction:
        try:
            out = fn(text)
        except Exception as e:  # noqa: BLE001 - user code
            msg = " ".join(str(e).split())[:300]
            raise ToolParserError(f"tool parser {parser.name!r} raised {type(e).__name__}: "
                                  f"{msg}") from None
        ok = isinstance(out, ParsedAction) and isinstance(out.content, str) \
            and isinstance(out.tool_calls, list) \
            and all(isinstance(c, ToolCall) for c in out.tool_calls)
        if not ok:
            raise ToolParserError(f"tool parser {parser.name!r} returned {out!r:.80} "
                                  f"({type(out).__name__}); expected a ParsedAction with str "
                                  "content and a list of ToolCalls")
        return out

    return ToolParser(parser.name, parse, parser.call_end)


def _add(got: ToolCall | str, calls: list[ToolCall], errors: list[str]) -> None:
    if isinstance(got, str):
        errors.append(got)
    else:
        calls.append(got)


def _strip_markers(text: str, markers: tuple[str, ...]) -> str:
    for m in markers:
        text = text.replace(m, "")
    return text


_LLAMA_END = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def parse_llama3_json(text: str) -> ParsedAction:
    """Llama 3.1 JSON tool calls: a turn that starts with `{` (after `<|python_tag|>` and
    whitespace) is one or more `{"name": ..., "parameters": {...}}` objects separated by `;`;
    any other turn is plain content.

    Args:
        text: decoded model turn (special tokens kept).
    Returns:
        ParsedAction (content is empty for a tool-call turn).
    """
    body = _strip_markers(text, _LLAMA_END).strip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedAction(content=body, tool_calls=[], errors=[])
    calls: list[ToolCall] = []
    errors: list[str] = []
    dec = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = dec.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            errors.append(f"invalid JSON in tool call: {exc.msg} at position {exc.pos}")
            break
        except RecursionError:
            errors.append("tool call JSON is nested too deeply")
            break
        got = tool_call_from_obj(obj, ("parameters", "arguments"))
        _add(got, calls, errors)
        rest = body[end:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            errors.append("text after a tool call (calls are separated by ';')")
            break
        pos = len(body) - len(rest[1:].lstrip())
    return ParsedAction(content="", tool_calls=calls, errors=errors)


_MISTRAL_END = ("</s>",)
_MISTRAL_CALLS = "[TOOL_CALLS]"


def parse_mistral(text: str) -> ParsedAction:
    """Mistral tool calls: content, then `[TOOL_CALLS]` and either a JSON list of
    `{"name", "arguments", "id"}` objects (v3 tokenizers) or `name[ARGS]{json}` items.

    Args:
        text: decoded model turn (special tokens kept).
    Returns:
        ParsedAction; the `id` a call carries is kept (its tool result must echo it).
    """
    text = _strip_markers(text, _MISTRAL_END)
    if _MISTRAL_CALLS not in text:
        return ParsedAction(content=text.strip(), tool_calls=[], errors=[])
    head, _, rest = text.partition(_MISTRAL_CALLS)
    calls: list[ToolCall] = []
    errors: list[str] = []
    for chunk in rest.split(_MISTRAL_CALLS):
        chunk = chunk.strip()
        if chunk.startswith(("[", "{")):
            obj, error = tool_call_json(chunk)
            if error:
                errors.append(error)
                continue
            for item in obj if isinstance(obj, list) else [obj]:
                got = tool_call_from_obj(item, ("arguments", "parameters"))
                _add(got, calls, errors)
        elif "[ARGS]" in chunk:
            name, _, args = chunk.partition("[ARGS]")
            got = tool_call_from_obj({"name": name.strip(), "arguments": args.strip()},
                                 ("arguments",))
            _add(got, calls, errors)
        else:
            errors.append("tool call must be a JSON list after [TOOL_CALLS]")
    return ParsedAction(content=head.strip(), tool_calls=calls, errors=errors)


BUILTIN_PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", parse_action, call_end="</tool_call>"),
    "llama3_json": ToolParser("llama3_json", parse_llama3_json),
    "mistral": ToolParser("mistral", parse_mistral),
}

_SPEC = re.compile(r"^(?P<mod>.+):(?P<attr>[A-Za-z_][A-Za-z0-9_]*)$")


def resolve_tool_parser(spec: str) -> ToolParser:
    """The parser for a built-in name, `package.module:function` or `path/file.py:function`.

    Raises:
        ValueError: one line naming the spec and what is wrong.
    """
    if spec in BUILTIN_PARSERS:
        return BUILTIN_PARSERS[spec]
    m = _SPEC.match(spec)
    if m is None:
        known = ", ".join(sorted(BUILTIN_PARSERS))
        raise ValueError(f"unknown tool parser {spec!r}: not one of {known} and not "
                         "module:function")
    mod_name, attr = m.group("mod"), m.group("attr")
    try:
        if mod_name.endswith(".py"):
            from megatron_gspo.agent.env import _load_file_module

            mod = _load_file_module(mod_name)
        else:
            mod = importlib.import_module(mod_name)
    except Exception as exc:  # noqa: BLE001 - user code
        raise ValueError(f"tool parser {spec!r}: cannot import {mod_name!r}: "
                         f"{type(exc).__name__}: {' '.join(str(exc).split())}") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise ValueError(f"tool parser {spec!r}: {mod_name!r} has no function {attr!r}")

    def checked(text: str) -> ParsedAction:
        out = fn(text)
        if not isinstance(out, ParsedAction):
            raise TypeError(f"tool parser {spec!r} returned {type(out).__name__}, "
                            "expected ParsedAction")
        return out

    return ToolParser(spec, checked)
