"""Environment for tests that kill a trainer in the middle of a python tool call: every step
first runs a python tool program that sleeps, then scores the turn as the calculator
environment does.

Config: `agent.environment: tests/agent/sleepy_python_env.py:SleepyPythonEnv`,
`agent.python_tool: true`.
"""

from __future__ import annotations

from megatron_gspo.agent.chat import ToolCall
from megatron_gspo.agent.envs import CalculatorEnv
from megatron_gspo.agent.env import StepResult

SLEEP_S = 600


class SleepyPythonEnv(CalculatorEnv):
    """CalculatorEnv whose every step first sleeps in the python tool for `SLEEP_S` seconds."""

    def __init__(self, python_tool: bool = False):
        super().__init__(system_prompt=None, python_tool=python_tool,
                         tool_timeout_s=SLEEP_S + 30,
                         python_kwargs={"wall_timeout_s": SLEEP_S + 20, "cpu_seconds": 5})

    def tool_schemas(self) -> list:
        return []  # a short prompt: the tiny demo model's context is short

    async def step(self, action: str) -> StepResult:
        if "python" in self.tools.tools:
            await self.tools.execute(ToolCall(
                "python", {"code": f"import time\nprint('sleeping')\ntime.sleep({SLEEP_S})"}))
        return await super().step(action)
