"""Environment of the multi-turn agent demo: arithmetic word problems with a calculator.

Config: `agent.environment: examples/multiturn_agent/env.py:ArithmeticAgentEnv`.
The tool list is not spelled out in the system prompt (the tiny demo model has a short context
and learned the call format in pre-training); a real model uses the built-in `calculator`
environment, which lists the tool schemas Qwen3-style.

Rewards: 1.0 for a correct final number; 0.1 for a turn whose calculator call succeeded
(a turn-level signal for GSPO-token); 0 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from megatron_gspo.agent.envs import CalculatorEnv, row_fields

sys.path.insert(0, str(Path(__file__).resolve().parent))
import task  # noqa: E402


class ArithmeticAgentEnv(CalculatorEnv):
    """CalculatorEnv with the demo's system prompt and shaping.

    Args:
        python_tool: also offer the sandboxed Python tool (off).
        tool_call_reward: reward of a turn whose tool calls all succeeded.
    """

    def __init__(self, python_tool: bool = False, tool_call_reward: float = 0.1):
        super().__init__(
            system_prompt=task.SYSTEM_PROMPT,
            python_tool=python_tool,
            correct_reward=1.0,
            tool_call_reward=tool_call_reward,
            tool_error_reward=0.0,
            tool_timeout_s=5.0,
            max_tool_output_chars=64,
        )

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    def first_messages(self, sample: Any) -> list[dict[str, Any]]:
        prompt, _ = row_fields(sample)
        return task.first_messages({"prompt": prompt})
