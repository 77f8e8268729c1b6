"""Glue between the RL loop and the agent package: episode rollouts and turn-level advantages
from the run configuration (`agent.*`, `rollout.*`, `algorithm.*`).

`rollout_episodes` plays `rollout.group_size` episodes for each of `train.prompts_per_step`
prompts (one Sample per episode, groups contiguous); `fill_turn_advantages` fills per-token
turn-level advantages for GSPO-token.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from megatron_gspo.agent import build_runner
from megatron_gspo.agent.runner import episode_metrics
from megatron_gspo.algo.turn_advantages import assign_multiturn_advantages
from megatron_gspo.data.sample import Sample


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
    from megatron_gspo.rollout.base import SamplingParams

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
