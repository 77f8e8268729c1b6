"""Environment protocol for multi-turn episodes, a tool-using base environment, and the
environment registry (by name, or `package.module:Class` for user environments).

One environment instance serves one episode:
- `await env.reset(sample)` returns the first observation (the chat that opens the episode);
- `await env.step(action)` takes the model's decoded turn and returns a `StepResult`:
  the observation to show next (tool results and/or user messages), the turn's reward, whether
  the episode is over, and an info dict whose numbers are summed into episode metrics.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from megatron_gspo.agent.chat import ParsedAction, parse_action
from megatron_gspo.agent.tools.toolset import ToolSet


@dataclass
class StepResult:
    """Outcome of one environment step.

    Attributes:
        observation: messages shown to the model next ([{"role": "tool"|"user", "content"}]).
        reward: reward of the turn that was just taken.
        done: the episode is over (the observation is then ignored).
        info: numbers are summed into the episode metrics; other values are kept as is.
    """

    observation: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. `tools` (may be empty) are listed in the system prompt."""

    def tool_schemas(self) -> list[dict[str, Any]]: ...

    async def reset(self, sample: Any) -> list[dict[str, Any]]: ...

    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None: ...


class ToolEnvironment:
    """Base environment that executes the tool calls in each model turn.

    A turn with tool calls gets their results as observation; a turn without calls is the final
    answer and is scored by `score_answer`. Malformed calls produce an error observation and are
    counted (`info["tool_errors/<kind>"]`). Subclasses implement `first_messages` and
    `score_answer`, and may override `tool_turn_reward`.

    Args:
        tools: the ToolSet offered to the model (None: no tools).
        max_tool_calls_per_turn: extra calls in one turn are refused with an error message.

    Attributes:
        tool_parser: decoded turn -> ParsedAction; the episode runner sets it from
            `agent.tool_parser` (default: the hermes/Qwen3 `parse_action`).
    """

    tool_parser: Callable[[str], ParsedAction] | None = None

    def __init__(self, tools: ToolSet | None = None, *, max_tool_calls_per_turn: int = 4):
        self.tools = tools
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.sample: Any = None

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.tools.schemas() if self.tools else []

    def first_messages(self, sample: Any) -> list[dict[str, Any]]:
        """The chat that opens the episode."""
        raise NotImplementedError

    def score_answer(self, content: str, sample: Any) -> tuple[float, dict[str, Any]]:
        """Reward (and info) of a final answer."""
        raise NotImplementedError

    def tool_turn_reward(self, parsed: ParsedAction, n_errors: int) -> float:
        """Reward of a turn that made tool calls (default 0)."""
        return 0.0

    async def reset(self, sample: Any) -> list[dict[str, Any]]:
        self.sample = sample
        return self.first_messages(sample)

    async def step(self, action: str) -> StepResult:
        parsed = (self.tool_parser or parse_action)(action)
        n_blocks = len(parsed.tool_calls) + len(parsed.errors)
        if n_blocks == 0:
            reward, info = self.score_answer(parsed.content, self.sample)
            return StepResult([], float(reward), True, {"answered": 1, **info})
        info: dict[str, Any] = {"tool_calls": n_blocks}
        contents: list[str] = []
        ids: list[str | None] = []
        n_err = 0
        for msg in parsed.errors:
            contents.append(f"Error: {msg}")
            ids.append(None)
            info["tool_errors/invalid_call"] = info.get("tool_errors/invalid_call", 0) + 1
            n_err += 1
        for i, call in enumerate(parsed.tool_calls):
            if self.tools is None:
                res_text, kind = "Error: no tools are available", "unknown_tool"
            elif i >= self.max_tool_calls_per_turn:
                res_text = f"Error: at most {self.max_tool_calls_per_turn} tool calls per turn"
                kind = "too_many_calls"
            else:
                res = await self.tools.execute(call)
                res_text, kind = res.content, res.error
                if res.truncated:
                    info["tool_outputs_truncated"] = info.get("tool_outputs_truncated", 0) + 1
            if kind is not None:
                info[f"tool_errors/{kind}"] = info.get(f"tool_errors/{kind}", 0) + 1
                n_err += 1
            contents.append(res_text)
            ids.append(call.id)
        obs = [{"role": "tool", "content": c, **({"tool_call_id": i} if i else {})}
               for c, i in zip(contents, ids, strict=True)]
        return StepResult(obs, float(self.tool_turn_reward(parsed, n_err)), False, info)

    async def close(self) -> None:
        return None


_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: make an environment constructible by `name`."""

    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"environment name {name!r} is already registered")
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_file_module(path: str) -> Any:
    """Import a Python file by path (its directory is put on sys.path for sibling imports)."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ImportError(f"no such file {path!r}")
    name = f"_gspo_env_{file.stem}_{abs(hash(str(file)))}"
    if name in sys.modules:
        return sys.modules[name]
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path!r}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def resolve_env(spec: str) -> Callable[..., Any]:
    """Environment class for a registered name, `package.module:Class` or `path/file.py:Class`.

    Raises:
        ValueError: unknown name, module that does not import, or missing class.
    """
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" not in spec:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise ValueError(
            f"unknown environment {spec!r}: not registered (known: {known}) and not module:Class"
        )
    mod_name, _, attr = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            mod = _load_file_module(mod_name)
        else:
            mod = importlib.import_module(mod_name)
    except Exception as exc:  # noqa: BLE001 - user code: SyntaxError, ImportError, ...
        detail = (f"{exc.msg} ({exc.filename}, line {exc.lineno})"
                  if isinstance(exc, SyntaxError) else " ".join(str(exc).split()))
        raise ValueError(f"environment {spec!r}: cannot import module {mod_name!r}: "
                         f"{type(exc).__name__}: {detail}") from None
    cls = getattr(mod, attr, None)
    if cls is None:
        raise ValueError(f"environment {spec!r}: module {mod_name!r} has no attribute {attr!r}")
    return cls


def make_env_factory(spec: str, kwargs: dict[str, Any] | None = None) -> Callable[[], Any]:
    """A zero-argument callable building a fresh environment per episode."""
    cls = resolve_env(spec)
    kw = dict(kwargs or {})
    return lambda: cls(**kw)
