"""Reward functions by name, user reward functions by `module:function`, and the batch helper
that scores Samples.

A reward function has the signature

    reward_fn(response_text: str, label, sample_metadata: dict) -> float

where `sample_metadata` holds the sample's metadata plus "prompt", "finish_reason", "index"
and "group_index". A reward function may carry a `check_label(label)` attribute that raises
ValueError for a label it cannot read (`label_check`); the trainer then treats such rows as bad
data rows at load time (the built-in math and exact_match rewards have one).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from megatron_gspo.data.sample import MAX_ABS_REWARD, Sample
from megatron_gspo.rewards.math import (
    exact_match_reward,
    math_boxed_strict_reward,
    math_reward,
)

RewardFn = Callable[[str, Any, dict], float]


class RewardError(ValueError):
    """An unknown reward name, a reward function that cannot be loaded, or a bad reward value."""


_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str, fn: RewardFn | None = None):
    """Register a reward function under a name (usable as a decorator).

    Args:
        name: the name used in config (`reward.name`); must not contain ":".
        fn: the function; omitted when used as @register_reward("name").
    Returns:
        fn (or the decorator).
    """
    if ":" in name:
        raise RewardError(f"reward name {name!r} must not contain ':' (reserved for module:fn)")

    def deco(f: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not f:
            raise RewardError(f"reward {name!r} is already registered")
        _REGISTRY[name] = f
        return f

    return deco(fn) if fn is not None else deco


def registered_rewards() -> list[str]:
    """Sorted names of the registered reward functions."""
    return sorted(_REGISTRY)


def get_reward_fn(spec: str) -> RewardFn:
    """Resolve a reward by registered name or as "package.module:function".

    Args:
        spec: a registered name ("math", "exact_match", ...) or "module:function" (the module
            must be importable, e.g. on PYTHONPATH or a path relative to the working directory
            given as "path/to/file.py:function").
    Returns:
        the reward function.
    """
    if not isinstance(spec, str) or not spec:
        raise RewardError(f"reward name must be a non-empty string, got {spec!r}")
    if ":" not in spec:
        if spec not in _REGISTRY:
            raise RewardError(f"unknown reward {spec!r}; registered: {registered_rewards()} "
                              "(or give 'module:function')")
        return _REGISTRY[spec]
    module_name, _, fn_name = spec.rpartition(":")
    if not module_name or not fn_name:
        raise RewardError(f"reward {spec!r} is not of the form 'module:function'")
    module = _import_module(module_name, spec)
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise RewardError(f"reward {spec!r}: module {module_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {fn_name!r} is not callable")
    try:
        inspect.signature(fn).bind("", None, {})
    except TypeError:
        raise RewardError(f"reward {spec!r} must accept (response_text, label, "
                          "sample_metadata)") from None
    except ValueError:
        pass  # builtins without a signature
    return fn


def label_check(fn: RewardFn) -> Callable[[Any], None] | None:
    """The reward function's `check_label(label)` (raises ValueError for a label it cannot
    read), or None when it has none."""
    check = getattr(fn, "check_label", None)
    return check if callable(check) else None


def _import_module(module_name: str, spec: str):
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise RewardError(f"reward {spec!r}: file {path} not found")
        mod_spec = importlib.util.spec_from_file_location(f"_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - user code: any failure is a config problem
            raise RewardError(f"reward {spec!r}: cannot load {path}: {_one_line(e)}") from None
        return module
    try:
        return importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - SyntaxError, ImportError, errors at import time
        raise RewardError(f"reward {spec!r}: cannot import module {module_name!r}: "
                          f"{_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    """`Type: message` of an exception on one line (file and line of a SyntaxError)."""
    if isinstance(e, SyntaxError):
        return f"{type(e).__name__}: {e.msg} ({e.filename}, line {e.lineno})"
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _as_real(value: Any) -> float | None:
    """A reward value as float: Python / numpy real numbers and one-element numeric torch
    tensors; None for anything else (strings, booleans, containers)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool \
            and not value.is_complex():
        return float(value.item())
    return None


def score_samples(
    samples: Sequence[Sample],
    reward_fn: RewardFn,
    detokenize: Callable[[list[int]], str],
    reward_kwargs: dict[str, Any] | None = None,
    mark_failed: bool = False,
) -> list[float]:
    """Compute and store `sample.reward` for every sample.

    Args:
        samples: the samples; their response_ids are decoded with `detokenize`.
        reward_fn: reward_fn(response_text, label, sample_metadata, **reward_kwargs) -> float.
        detokenize: token ids -> text (e.g. tokenizer.decode with skip_special_tokens=True).
        reward_kwargs: extra keyword arguments for the reward function (config reward.kwargs).
        mark_failed: what a reward function that raises, or returns something other than a
            finite real number, does to its sample. False: a RewardError (one line naming
            the sample). True (the trainer): that sample gets reward 0 and the failed-sample
            mark `metadata["rollout_error"]` with the same line, so its group is dropped and
            counted like a failed generation (group sampling stops with one line only when
            every group of a round failed): one bad sample never ends a run.
    Returns:
        the rewards, in sample order.
    """
    rewards = []
    kwargs = dict(reward_kwargs or {})
    for s in samples:
        try:
            value = _score_one(s, reward_fn, detokenize, kwargs)
        except RewardError as e:
            if not mark_failed:
                raise
            value = 0.0
            s.metadata.setdefault("rollout_error", str(e))
        s.reward = value
        rewards.append(value)
    return rewards


def _score_one(s: Sample, reward_fn: RewardFn, detokenize: Callable[[list[int]], str],
               kwargs: dict[str, Any]) -> float:
    """One sample's reward as a finite float, or a RewardError naming the sample."""
    text = detokenize(list(s.response_ids))
    meta = dict(s.metadata)
    meta.update(prompt=s.prompt, finish_reason=s.finish_reason, index=s.index,
                group_index=s.group_index)
    name = getattr(reward_fn, "__name__", repr(reward_fn))
    try:
        value = reward_fn(text, s.label, meta, **kwargs)
    except Exception as e:
        raise RewardError(f"reward {name} failed on sample {s.index} (group "
                          f"{s.group_index}): {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}") from e
    real = _as_real(value)
    if real is None:
        raise RewardError(f"reward {name} returned {type(value).__name__} {value!r:.40} for "
                          f"sample {s.index}; expected a real number (int or float)")
    value = real
    if not math.isfinite(value):
        raise RewardError(f"reward {name} returned {value} for sample {s.index}")
    if abs(value) > MAX_ABS_REWARD:
        raise RewardError(f"reward {name} returned {value:g} for sample {s.index} (group "
                          f"{s.group_index}): outside [{-MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}]"
                          ", where group advantages stay finite in float32")
    return value


register_reward("math", math_reward)
register_reward("math_boxed_strict", math_boxed_strict_reward)
register_reward("exact_match", exact_match_reward)
