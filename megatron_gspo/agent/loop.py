"""Glue between the RL loop and the agent package: episode rollouts and turn-level advantages
from the run configuration (`agent.*`, `rollout.*`, `algorithm.*`).

`rollout_episodes` plays `rollout.group_size` episodes for each of `train.prompts_per_step`
prompts (one Sample per episode, groups contiguous); `fill_turn_advantages` fills per-token
turn-level advantages for GSPO-token.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from megatron_gspo.agent import build_runner
from megatron_gspo.agent.runner import episode_metrics
from megatron_gspo.algo.turn_advantages import assign_multiturn_advantages
from megatron_gspo.data.sample import Sample
from megatron_gspo.rollout.engine import RolloutError


def _item(req: Any) -> dict[str, Any]:
    """The environment's view of one prompt request: {"prompt", "label", ...}."""
    meta = dict(getattr(req, "metadata", None) or {})
    return {**meta, "prompt": req.prompt, "label": req.label}


def _check(cfg: Any) -> None:
    if cfg.data.apply_chat_template:
        raise ValueError("data.apply_chat_template: must be false with agent.enabled (the "
                         "environment renders the chat from the raw prompt)")


def make_runner(cfg: Any, engine: Any, tok: Any, temperature: float | None = None):
    """EpisodeRunner configured from `agent.*` and `rollout.*` (`temperature` overrides
    `rollout.temperature`, e.g. for evaluation; 0 is greedy)."""
    from megatron_gspo.rollout.engine import SamplingParams

    _check(cfg)
    sampling = SamplingParams.for_rollouts(cfg.rollout, tok).with_n(1)
    if temperature is not None:
        sampling = replace(sampling, temperature=temperature)
    a = cfg.agent
    return build_runner(
        engine, tok, environment=a.environment, env_kwargs=dict(a.env_kwargs),
        python_tool=a.python_tool, enable_thinking=a.enable_thinking,
        stop_on_tool_call_end=a.stop_on_tool_call_end, max_concurrent=a.max_concurrent,
        sampling=sampling, max_turns=a.max_turns,
        max_total_tokens=a.max_total_tokens, max_new_tokens_per_turn=cfg.rollout.max_new_tokens,
        turn_timeout_s=a.turn_timeout, episode_timeout_s=a.episode_timeout,
        chat_template=a.chat_template, tool_parser=a.tool_parser,
    )


def rollout_episodes(
    cfg: Any, engine: Any, requests: Iterable[Any], tok: Any, step: int
) -> tuple[list[Sample], dict[str, float]]:
    """Play `rollout.group_size` episodes for each of `train.prompts_per_step` prompts.

    Args:
        cfg: the run Config.
        engine: the RolloutEngine.
        requests: GenerateRequest-like objects (prompt text, label, metadata); the first
            `train.prompts_per_step` are used.
        tok: the policy tokenizer.
        step: RL step (for error messages).
    Returns:
        (samples, metrics): samples grouped by prompt (group_index = prompt position), with
        reward = sum of turn rewards; metrics prefixed `agent/`.
    """
    _check(cfg)
    items = [_item(r) for r in itertools.islice(requests, cfg.train.prompts_per_step)]
    if not items:
        raise RuntimeError(f"step {step}: no prompts for the agent rollout")
    runner = make_runner(cfg, engine, tok)
    samples = runner.run_batch_sync(items, n_per_prompt=cfg.rollout.group_size)
    metrics = episode_metrics(samples)
    metrics["events"] = _episode_failures(samples, step)
    if cfg.rollout.drop_zero_variance_groups:
        g = cfg.rollout.group_size
        keep: list[Sample] = []
        for start in range(0, len(samples), g):
            group = samples[start : start + g]
            if len({float(s.reward) for s in group}) > 1:
                keep.extend(group)
        metrics["agent/dropped_groups"] = float((len(samples) - len(keep)) // g)
        samples = keep
    for i, s in enumerate(samples):
        s.index = i
    return samples, metrics


_REPORTED: set[str] = set()  # kinds of episode errors already in the log (first one each)


def _episode_failures(samples: list[Sample], step: int) -> list[str]:
    """Log lines for the first episode error of each kind (tool parser, chat template,
    environment) in this process; RolloutError when every episode failed, or when no episode
    holds a token to train.

    Returns:
        the new log lines (for events.log).
    """
    failed = [s for s in samples if "env_error" in s.metadata]
    notes = []
    for s in failed:
        kind = s.metadata.get("error_kind", "environment")
        if kind not in _REPORTED:
            _REPORTED.add(kind)
            notes.append(f"step {step}: first {kind} error in an episode (the episode is "
                         f"dropped to reward 0): {s.metadata['env_error']}")
    if failed and len(failed) == len(samples):
        first = failed[0].metadata
        raise RolloutError(f"step {step}: every one of {len(samples)} episodes failed; the "
                           f"first {first.get('error_kind', 'environment')} error: "
                           f"{first['env_error']}")
    if samples and not any(s.num_trainable for s in samples):
        stops = sorted({str(s.metadata.get("stop_reason")) for s in samples})
        raise RolloutError(f"step {step}: none of {len(samples)} episodes holds a model token "
                           f"to train (stop reasons: {', '.join(stops)}); is "
                           "agent.max_total_tokens shorter than the opening prompt?")
    return notes


def check_opening_prompts(cfg: Any, tok: Any, items: Sequence[Any], rows: int = 8) -> None:
    """The rendered opening prompt (environment reset, tool list, chat template) of the first
    `rows` dataset items leaves room under `agent.max_total_tokens` for the model's turns.

    Raises:
        ConfigError naming both numbers and the row.
    """
    import asyncio

    from megatron_gspo.agent.runner import opening_prompt
    from megatron_gspo.config import ConfigError

    runner = make_runner(cfg, _NoEngine(), tok)
    limit = cfg.agent.max_total_tokens
    for item in items[:rows]:
        n = len(asyncio.run(opening_prompt(runner, _item(item))))
        if n >= limit:
            raise ConfigError(f"agent.max_total_tokens: {limit} tokens, but the rendered "
                              f"opening prompt of row {getattr(item, 'row', '?')} (tool list "
                              f"included) is {n} tokens; raise agent.max_total_tokens above "
                              f"{n} plus room for the model's turns")


class _NoEngine:
    """Stands in for the engine where only prompts are rendered (no generation)."""

    default_sampling = None
    weight_version = 0


def evaluate_episodes(cfg: Any, engine: Any, requests: Iterable[Any], tok: Any) -> dict:
    """One episode per evaluation prompt at `train.eval_temperature` (0: greedy).

    Returns:
        {"eval/reward_mean", "eval/prompts", "eval/agent/<metric>" ...}
    """
    items = [_item(r) for r in requests]
    if not items:
        return {}
    runner = make_runner(cfg, engine, tok, temperature=cfg.train.eval_temperature)
    samples = runner.run_batch_sync(items, n_per_prompt=1)
    out = {f"eval/{k}": v for k, v in episode_metrics(samples).items()}
    out.update({"eval/reward_mean": out["eval/agent/reward"], "eval/prompts": float(len(samples))})
    return out


def fill_turn_advantages(cfg: Any, samples: list[Sample]) -> None:
    """Per-token turn-level advantages (discount `agent.turn_discount`, group-normalised)."""
    assign_multiturn_advantages(
        samples, mode="turn", gamma=cfg.agent.turn_discount,
        normalization=cfg.agent.turn_normalization,
        scale_by_std=cfg.algorithm.advantage_scale == "std", eps=cfg.algorithm.advantage_eps,
    )
