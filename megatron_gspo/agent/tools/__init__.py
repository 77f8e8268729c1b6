"""Tools offered to the model in multi-turn episodes."""

from __future__ import annotations

from typing import Any

from megatron_gspo.agent.tools.toolset import Tool, ToolError, ToolResult, ToolSet, tool_schema
from megatron_gspo.agent.tools.calculator import Calculator
from megatron_gspo.agent.tools.python_sandbox import PythonSandbox
from megatron_gspo.config.tool_limits import check_python_limits

__all__ = [
    "Calculator", "PythonSandbox", "Tool", "ToolError", "ToolResult", "ToolSet", "build_toolset",
    "tool_schema",
]


def build_toolset(
    *,
    calculator: bool = True,
    python: bool = False,
    timeout_s: float = 10.0,
    max_output_chars: int = 2000,
    python_kwargs: dict[str, Any] | None = None,
) -> ToolSet:
    """The standard tools: calculator (on by default) and the Python sandbox (off by default).

    Args:
        calculator, python: which tools to offer.
        timeout_s: per-call wall-clock limit (the sandbox's own limit is kept below it).
        max_output_chars: cap on each tool result shown to the model.
        python_kwargs: PythonSandbox arguments (cpu_seconds, memory_mb, wall_timeout_s, ...).
    """
    tools: list[Any] = []
    if calculator:
        tools.append(Calculator())
    if python:
        given = check_python_limits(python_kwargs, "python_kwargs")
        kw = {"wall_timeout_s": max(timeout_s - 1.0, 0.5), **given}
        tools.append(PythonSandbox(**kw))
    return ToolSet(tools, timeout_s=timeout_s, max_output_chars=max_output_chars)
