"""Tool protocol and a tool set that executes parsed calls safely.

Every failure of a call (unknown tool, bad arguments, tool error, timeout) becomes an error
observation for the model plus an error kind counted in the episode metrics; nothing raises
out of `ToolSet.execute`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from megatron_gspo.agent.chat import ToolCall

ERROR_KINDS = ("invalid_call", "unknown_tool", "bad_arguments", "tool_error", "timeout")


class ToolError(Exception):
    """Raised by a tool for a call it cannot serve; the message is shown to the model."""


@runtime_checkable
class Tool(Protocol):
    """A callable tool: `name`, `description`, JSON-schema `parameters`, async `__call__`."""

    name: str
    description: str
    parameters: dict[str, Any]

    async def __call__(self, arguments: dict[str, Any]) -> str: ...


def tool_schema(tool: Tool) -> dict[str, Any]:
    """Function-calling schema of a tool, as listed in the system prompt."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


@dataclass
class ToolResult:
    """Outcome of one call: text for the model, and the error kind if it failed."""

    content: str
    error: str | None = None
    truncated: bool = False


def truncate_output(text: str, max_chars: int) -> tuple[str, bool]:
    """Cut `text` to `max_chars` characters, saying how much was dropped."""
    if len(text) <= max_chars:
        return text, False
    dropped = len(text) - max_chars
    return f"{text[:max_chars]}\n... [output truncated: {dropped} more characters]", True


class ToolSet:
    """Tools by name, executed with a timeout and an output cap.

    Args:
        tools: the tools; names must be unique.
        timeout_s: wall-clock limit per call.
        max_output_chars: longer outputs are truncated (and counted).
    """

    def __init__(self, tools: list[Tool], *, timeout_s: float = 10.0, max_output_chars: int = 2000):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"duplicate tool name {t.name!r}")
            self.tools[t.name] = t
        if timeout_s <= 0 or max_output_chars <= 0:
            raise ValueError("ToolSet: timeout_s and max_output_chars must be positive")
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars

    def schemas(self) -> list[dict[str, Any]]:
        """Schemas of all tools, for the system prompt."""
        return [tool_schema(t) for t in self.tools.values()]

    async def execute(self, call: ToolCall) -> ToolResult:
        """Run one call; never raises (except on cancellation)."""
        tool = self.tools.get(call.name)
        if tool is None:
            names = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(
                f"Error: unknown tool {call.name!r}; available tools: {names}", "unknown_tool"
            )
        try:
            out = await asyncio.wait_for(tool(call.arguments), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            return ToolResult(
                f"Error: tool {call.name!r} timed out after {self.timeout_s:g} s", "timeout"
            )
        except ToolError as exc:
            return ToolResult(f"Error: {exc}", "tool_error")
        except (TypeError, KeyError, ValueError) as exc:
            return ToolResult(f"Error: bad arguments for {call.name!r}: {exc}", "bad_arguments")
        except Exception as exc:  # noqa: BLE001  (a tool bug must not end the run)
            return ToolResult(
                f"Error: tool {call.name!r} failed: {type(exc).__name__}", "tool_error"
            )
        if not isinstance(out, str):
            out = str(out)
        text, cut = truncate_output(out, self.max_output_chars)
        return ToolResult(text, None, cut)
