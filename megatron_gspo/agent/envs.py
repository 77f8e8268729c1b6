"""Built-in environments.

`calculator`: a question with a numeric answer; the model may call the calculator (and the
sandboxed Python tool when enabled) and ends the episode with a turn that has no tool call.
Reward: `correct_reward` when the last number of the final answer equals the label (within a
relative tolerance), plus optional shaping per successful / failed tool call.
"""

from __future__ import annotations

import math
import re
from typing import Any

from megatron_gspo.agent.chat import ParsedAction
from megatron_gspo.agent.env import ToolEnvironment, register_env
from megatron_gspo.agent.tools import build_toolset

DEFAULT_SYSTEM = (
    "Solve the problem. Use the calculator tool for arithmetic. "
    "When you are done, reply with the final answer as a number and no tool call."
)
_NUM = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in `text` (commas as thousands separators allowed), or None."""
    found = _NUM.findall(text)
    if not found:
        return None
    return float(found[-1].replace(",", ""))


def row_fields(item: Any) -> tuple[Any, Any]:
    """(prompt, label) of a dataset row (dict with prompt and label/answer) or a Sample."""
    if isinstance(item, dict):
        if "prompt" not in item:
            raise ValueError("environment row has no 'prompt' field")
        return item["prompt"], item.get("label", item.get("answer"))
    return item.prompt, getattr(item, "label", None)


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as a list of {role, content} dicts; ValueError naming the first bad one."""
    if not isinstance(messages, list):
        raise ValueError("calculator environment: demonstration must be a list of messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"calculator environment: demonstration message {i} needs a "
                             "string 'role' and 'content'")
    return [dict(m) for m in messages]


@register_env("calculator")
class CalculatorEnv(ToolEnvironment):
    """Numeric question answering with a calculator tool.

    Args:
        system_prompt: system message (None: no system message besides the tool list).
        python_tool: also offer the sandboxed Python tool.
        correct_reward: reward of a correct final answer.
        tool_call_reward: reward of a turn whose tool calls all succeeded.
        tool_error_reward: reward of a turn with a failed tool call (e.g. a small penalty).
        rel_tol: relative tolerance of the answer comparison.
        tool_timeout_s, max_tool_output_chars: ToolSet limits.
        python_kwargs: PythonSandbox arguments.
        demonstration: chat messages shown between the system message and the question, e.g.
            a worked example (user question, assistant tool call, tool result, assistant
            answer) for a model too small to follow a written call format; each a dict with
            a string `role` and `content`.
    """

    def __init__(
        self,
        *,
        system_prompt: str | None = DEFAULT_SYSTEM,
        python_tool: bool = False,
        correct_reward: float = 1.0,
        tool_call_reward: float = 0.0,
        tool_error_reward: float = 0.0,
        rel_tol: float = 1e-6,
        tool_timeout_s: float = 10.0,
        max_tool_output_chars: int = 2000,
        python_kwargs: dict[str, Any] | None = None,
        demonstration: list[dict[str, Any]] | None = None,
    ):
        super().__init__(
            build_toolset(
                python=python_tool, timeout_s=tool_timeout_s,
                max_output_chars=max_tool_output_chars, python_kwargs=python_kwargs,
            )
        )
        self.system_prompt = system_prompt
        self.correct_reward = correct_reward
        self.tool_call_reward = tool_call_reward
        self.tool_error_reward = tool_error_reward
        self.rel_tol = rel_tol
        self.demonstration = _checked_messages(demonstration or [])

    def first_messages(self, sample: Any) -> list[dict[str, Any]]:
        prompt, _ = row_fields(sample)
        msgs = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        has_system = bool(msgs) and msgs[0].get("role") == "system"
        at = 1 if has_system else 0
        msgs[at:at] = [dict(m) for m in self.demonstration]
        if self.system_prompt and not has_system:
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    @staticmethod
    def check_label(label: Any) -> float:
        """The label as a number; ValueError when there is none or it is not numeric (the
        trainer checks every row with this before training)."""
        if label is None:
            raise ValueError("calculator environment: row has no 'label'/'answer'")
        if isinstance(label, bool):
            raise ValueError("calculator environment: label is a boolean, not a number")
        try:
            want = float(str(label).replace(",", ""))
        except ValueError:
            raise ValueError("calculator environment: label is not a number") from None
        if not math.isfinite(want):
            raise ValueError("calculator environment: label is not a finite number")
        return want

    def score_answer(self, content: str, sample: Any) -> tuple[float, dict[str, Any]]:
        _, label = row_fields(sample)
        want = self.check_label(label)
        got = last_number(content)
        ok = got is not None and math.isclose(got, want, rel_tol=self.rel_tol, abs_tol=1e-9)
        return (self.correct_reward if ok else 0.0), {"correct": int(ok)}

    def tool_turn_reward(self, parsed: ParsedAction, n_errors: int) -> float:
        return self.tool_error_reward if n_errors else self.tool_call_reward
