"""Multi-turn agent episodes: environments, tools, chat rendering (the tokenizer's own chat
template or the built-in Qwen3 renderer), tool-call parsers, the episode runner.

Typical use in the RL loop:

    runner = build_runner(engine, tokenizer, environment="calculator", max_turns=4, ...)
    samples = runner.run_batch_sync(rows, n_per_prompt=G)   # one Sample per episode
    assign_multiturn_advantages(samples, mode="turn", gamma=0.9)   # algo.turn_advantages
"""

from __future__ import annotations

from typing import Any

from megatron_gspo.agent.chat import QWEN3, ChatFormat, ToolCall, parse_action, render_messages
from megatron_gspo.agent.env import (
    Environment,
    StepResult,
    ToolEnvironment,
    make_env_factory,
    register_env,
    resolve_env,
)
from megatron_gspo.agent.envs import CalculatorEnv
from megatron_gspo.agent.chat_session import ChatTemplateError
from megatron_gspo.agent.runner import EngineBatcher, EpisodeLimits, EpisodeRunner, episode_metrics
from megatron_gspo.agent.tool_parsers import ToolParser, resolve_tool_parser

__all__ = [
    "QWEN3", "CalculatorEnv", "ChatFormat", "ChatTemplateError", "EngineBatcher", "Environment",
    "EpisodeLimits", "EpisodeRunner", "StepResult", "ToolCall", "ToolEnvironment", "ToolParser",
    "build_runner", "episode_metrics", "make_env_factory", "parse_action", "register_env",
    "render_messages", "resolve_env", "resolve_tool_parser",
]


def build_runner(
    engine: Any,
    tokenizer: Any,
    *,
    environment: str = "calculator",
    env_kwargs: dict[str, Any] | None = None,
    python_tool: bool = False,
    sampling: Any = None,
    max_turns: int = 4,
    max_total_tokens: int = 2048,
    max_new_tokens_per_turn: int = 512,
    turn_timeout_s: float = 60.0,
    episode_timeout_s: float = 600.0,
    enable_thinking: bool = False,
    stop_on_tool_call_end: bool = True,
    max_concurrent: int = 256,
    batch_requests: bool | None = None,
    chat_template: str = "tokenizer",
    tool_parser: str = "hermes",
) -> EpisodeRunner:
    """An EpisodeRunner from plain settings (the `agent.*` config fields map one to one).

    Args:
        engine: RolloutEngine.
        tokenizer: Hugging Face-style tokenizer of the policy.
        environment: registered name, `package.module:Class` or `path/file.py:Class`.
        env_kwargs: constructor arguments of the environment.
        python_tool: pass `python_tool=True` to the environment (only when set).
        sampling: SamplingParams of every turn (None: the engine's defaults).
        max_turns, max_total_tokens, max_new_tokens_per_turn, turn_timeout_s,
            episode_timeout_s: see EpisodeLimits.
        enable_thinking, stop_on_tool_call_end, max_concurrent: see EpisodeRunner.
        batch_requests: see EpisodeRunner; None batches only for the in-process engine.
        chat_template: `tokenizer` (its own chat template), `builtin` or a `.jinja` file.
        tool_parser: `hermes`, `llama3_json`, `mistral` or `module:function`.
    Returns:
        the runner.
    """
    kwargs = dict(env_kwargs or {})
    if python_tool:
        kwargs["python_tool"] = True
    limits = EpisodeLimits(
        max_turns=max_turns, max_total_tokens=max_total_tokens,
        max_new_tokens_per_turn=max_new_tokens_per_turn, turn_timeout_s=turn_timeout_s,
        episode_timeout_s=episode_timeout_s,
    )
    if batch_requests is None:
        from megatron_gspo.rollout.embedded import EmbeddedEngine

        batch_requests = isinstance(engine, EmbeddedEngine)
    return EpisodeRunner(
        engine, tokenizer, make_env_factory(environment, kwargs), sampling=sampling,
        limits=limits, enable_thinking=enable_thinking,
        stop_on_tool_call_end=stop_on_tool_call_end, max_concurrent=max_concurrent,
        batch_requests=batch_requests, chat_template=chat_template, tool_parser=tool_parser,
    )
