"""Token-in/token-out multi-turn episode runner on top of a RolloutEngine.

Each turn sends the exact token context (prompt + everything so far) to the engine and keeps
the generated ids and log-probs as returned (never decoded and re-encoded). The decoded text is
only used to let the environment act. Environment text (tool results, user replies, the turn
framing) is tokenised and appended with loss mask 0 and rollout log-prob 0.0. One `Sample` per
episode: `turn_ids` give each response token's turn, `turn_rewards` the per-turn rewards.

Episodes stop when the environment says done, after `max_turns` model turns, when the episode
would exceed `max_total_tokens`, or on per-turn / per-episode timeouts. Many episodes run
concurrently (asyncio); `EngineBatcher` merges their concurrent turn requests into engine batches.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_gspo.agent.chat import QWEN3, ChatFormat
from megatron_gspo.agent.chat_session import ChatTemplateError, TemplateRenderError, make_chat
from megatron_gspo.agent.tool_parsers import (ToolParser, ToolParserError, checked_parser,
                                              resolve_tool_parser)
from megatron_gspo.agent.episode_stats import episode_metrics, merge_info  # noqa: F401
from megatron_gspo.agent.interrupt import run_cancel_on_interrupt
from megatron_gspo.data.sample import MAX_ABS_REWARD, Sample
from megatron_gspo.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of one episode.

    Attributes:
        max_turns: most model turns.
        max_total_tokens: most tokens of the whole episode (prompt + model + environment).
        max_new_tokens_per_turn: most tokens the model generates in one turn.
        turn_timeout_s: wall-clock limit of one generation call.
        episode_timeout_s: wall-clock limit of the whole episode (generation + environment).
    """

    max_turns: int = 4
    max_total_tokens: int = 2048
    max_new_tokens_per_turn: int = 256
    turn_timeout_s: float = 120.0
    episode_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_new_tokens_per_turn"):
            if getattr(self, name) < 1:
                raise ValueError(f"agent.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("turn_timeout_s", "episode_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"agent.{name} must be > 0, got {getattr(self, name)}")


class EngineBatcher:
    """Merges concurrent single-turn requests from many episodes into `agenerate` batches.

    A batch is sent when `expected()` requests are waiting (all live episodes asked) or
    `max_wait_s` after the first one arrived, whichever comes first.

    Args:
        engine: the rollout engine.
        max_wait_s: longest wait for more requests before sending a batch.
        expected: callable giving how many requests to wait for (default: send at once).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        max_wait_s: float = 0.02,
        expected: Callable[[], int] | None = None,
    ):
        self.engine = engine
        self.max_wait_s = max_wait_s
        self.expected = expected or (lambda: 1)
        self._pending: list[tuple[GenerateRequest, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flusher: asyncio.Task | None = None
        self.batch_sizes: list[int] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Sample:
        """Generate one response (n=1) for `prompt_ids`."""
        loop = asyncio.get_running_loop()
        if self._wake is None or self._loop is not loop:  # first use, or a new event loop
            self._wake, self._loop = asyncio.Event(), loop
        fut: asyncio.Future = loop.create_future()
        self._pending.append((GenerateRequest(list(prompt_ids), sampling), fut))
        self._wake.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return await fut

    def poke(self) -> None:
        """Re-check the batch condition (call when the number of live episodes drops)."""
        if self._wake is not None:
            self._wake.set()

    async def _flush(self) -> None:
        assert self._wake is not None
        deadline = time.monotonic() + self.max_wait_s
        while len(self._pending) < max(1, self.expected()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                break
        batch, self._pending = self._pending, []
        self._flusher = None
        if not batch:
            return
        self.batch_sizes.append(len(batch))
        try:
            samples = await self.engine.agenerate([r for r, _ in batch])
            if len(samples) != len(batch):
                raise RuntimeError(
                    f"engine returned {len(samples)} samples for {len(batch)} requests"
                )
        except Exception as exc:  # noqa: BLE001  (hand the failure to every waiting episode)
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), s in zip(batch, samples, strict=False):
            if not fut.done():
                fut.set_result(s)


class EpisodeRunner:
    """Runs multi-turn episodes against an engine and builds one Sample per episode.

    Args:
        engine: the rollout engine (its `agenerate` is called with token ids).
        tokenizer: Hugging Face-style tokenizer (`encode(text, add_special_tokens=False)`,
            `decode(ids, skip_special_tokens=False)`).
        env_factory: zero-argument callable returning a fresh environment per episode.
        sampling: sampling parameters of every turn (max_new_tokens and n are set per turn).
        limits: episode bounds.
        fmt: the built-in renderer's chat format.
        stop_on_tool_call_end: end a turn at the tool parser's call-closing token (hermes:
            `</tool_call>`; one call per turn).
        enable_thinking: Qwen3 thinking on/off in the assistant turn openings.
        chat_template: `builtin` (Qwen3 renderer of `agent.chat`), `tokenizer` (the
            tokenizer's own chat template) or a `.jinja` file (see `agent.chat_session`). The
            end of an assistant turn (`<|im_end|>` for the built-in one) always stops a turn.
        tool_parser: `hermes`, `llama3_json`, `mistral`, `module:function` or a ToolParser;
            environments with a `tool_parser` attribute get its `parse`.
        max_concurrent: most episodes in flight.
        batch_requests: merge concurrent turns into engine batches (`EngineBatcher`; right for
            the in-process engine); False sends each turn as its own request (right for HTTP
            servers that batch by themselves, so a slow turn does not hold others back).
        batch_wait_s: see `EngineBatcher`.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        env_factory: Callable[[], Any],
        *,
        sampling: SamplingParams | None = None,
        limits: EpisodeLimits | None = None,
        fmt: ChatFormat = QWEN3,
        stop_on_tool_call_end: bool = True,
        enable_thinking: bool = False,
        max_concurrent: int = 256,
        batch_requests: bool = True,
        batch_wait_s: float = 0.02,
        chat_template: str = "builtin",
        tool_parser: str | ToolParser = "hermes",
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.sampling = sampling or engine.default_sampling
        self.limits = limits or EpisodeLimits()
        self.fmt = fmt
        self.enable_thinking = enable_thinking
        if max_concurrent < 1:
            raise ValueError(f"agent.max_concurrent must be >= 1, got {max_concurrent}")
        self.max_concurrent = max_concurrent
        self.parser = checked_parser(tool_parser if isinstance(tool_parser, ToolParser)
                                     else resolve_tool_parser(tool_parser))
        self.chat = make_chat(chat_template, tokenizer, self.parser, fmt=fmt,
                              enable_thinking=enable_thinking)
        self.im_end_id = self._single_token(self.chat.turn_end)
        stops = set(self.sampling.stop_token_ids) | {self.im_end_id}
        if stop_on_tool_call_end and self.parser.call_end:
            stops.add(self._single_token(self.parser.call_end))
        self.stop_token_ids = tuple(sorted(stops))
        self._live = 0
        self.batch_requests = batch_requests
        self.batcher = EngineBatcher(engine, batch_wait_s, expected=lambda: self._live)

    async def _generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Sample:
        if self.batch_requests:
            return await self.batcher.generate(prompt_ids, sampling)
        out = await self.engine.agenerate([GenerateRequest(list(prompt_ids), sampling)])
        if len(out) != 1:
            raise RuntimeError(f"engine returned {len(out)} samples for 1 request")
        return out[0]

    def _single_token(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"tokenizer encodes {text!r} as {len(ids)} tokens; it must be one")
        return int(ids[0])

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ------------------------------------------------------------------ one episode
    async def run_episode(self, item: Any, *, group_index: int = 0, index: int = 0) -> Sample:
        """Play one episode on a fresh environment.

        Args:
            item: dataset row handed to `env.reset`; its "label" (if a dict) is copied.
            group_index, index: copied to the Sample.
        Returns:
            the episode's Sample (reward = sum of turn rewards).
        """
        lim = self.limits
        t0 = time.monotonic()
        deadline = t0 + lim.episode_timeout_s
        env = self.env_factory()
        if hasattr(env, "tool_parser"):
            env.tool_parser = self.parser.parse
        chat = self.chat.session()
        metrics: dict[str, Any] = {}
        resp: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        tids: list[int] = []
        rewards: list[float] = []
        versions: list[int] = []
        finish, stop = "length", "max_turns"
        prompt_ids: list[int] = []
        engine_lps = True  # False once a turn came back without log-probs
        try:
            messages = await asyncio.wait_for(env.reset(item), lim.episode_timeout_s)
            prompt_text = chat.start(messages, env.tool_schemas())
            prompt_ids = self._encode(prompt_text)
            for turn in range(lim.max_turns):
                room = lim.max_total_tokens - len(prompt_ids) - len(resp)
                if room <= 0:
                    finish, stop = "length", "max_total_tokens"
                    break
                budget = min(lim.max_new_tokens_per_turn, room)
                left = deadline - time.monotonic()
                if left <= 0:
                    finish, stop = "abort", "episode_timeout"
                    break
                sp = replace(
                    self.sampling, max_new_tokens=budget, n=1, stop_token_ids=self.stop_token_ids
                )
                try:
                    out = await asyncio.wait_for(
                        self._generate(prompt_ids + resp, sp),
                        min(lim.turn_timeout_s, left),
                    )
                except asyncio.TimeoutError:
                    timed_out_episode = time.monotonic() >= deadline
                    finish = "abort"
                    stop = "episode_timeout" if timed_out_episode else "turn_timeout"
                    break
                except Exception as exc:  # engine failures end the run, not just the episode
                    raise _EngineFailure(exc) from exc
                gen = list(out.response_ids)
                if out.rollout_logprobs is None:
                    engine_lps = False
                glp = list(out.rollout_logprobs or [0.0] * len(gen))
                versions.append(out.weight_version)
                resp += gen
                mask += list(out.loss_mask)  # 0 where the engine gave up on the turn
                if "rollout_error" in out.metadata:
                    metrics["rollout_error"] = out.metadata["rollout_error"]
                lps += glp
                tids += [turn] * len(gen)
                if out.finish_reason != "stop":
                    rewards.append(0.0)
                    finish = out.finish_reason
                    if out.finish_reason != "length":
                        stop = "engine_abort"
                    elif budget < lim.max_new_tokens_per_turn:
                        stop = "max_total_tokens"
                    else:
                        stop = "turn_length"
                    break
                text = self.tokenizer.decode(gen, skip_special_tokens=False)
                try:
                    res = await asyncio.wait_for(
                        env.step(text), max(deadline - time.monotonic(), 1e-3)
                    )
                except asyncio.TimeoutError:
                    rewards.append(0.0)
                    finish, stop = "abort", "episode_timeout"
                    break
                rewards.append(_turn_reward(res.reward))
                merge_info(metrics, res.info)
                if res.done:
                    finish, stop = "stop", "done"
                    break
                if turn == lim.max_turns - 1:
                    break
                last = self.tokenizer.decode(gen[-1:], skip_special_tokens=False) if gen else ""
                obs_text = chat.observe(text, last, res.observation)
                obs = self._encode(obs_text)
                if len(prompt_ids) + len(resp) + len(obs) >= lim.max_total_tokens:
                    finish, stop = "length", "max_total_tokens"
                    break
                resp += obs
                mask += [0] * len(obs)
                lps += [0.0] * len(obs)
                tids += [turn] * len(obs)
        except _EngineFailure as exc:
            raise exc.__cause__ from None
        except ChatTemplateError:
            raise  # the template, not this episode, is at fault: one clear error for the run
        except Exception as exc:  # noqa: BLE001  (a broken environment ends only its episode)
            finish, stop = "abort", "env_error"
            metrics["env_error"] = f"{type(exc).__name__}: {exc}"
            metrics["error_kind"] = ("tool parser" if isinstance(exc, ToolParserError) else
                                     "chat template" if isinstance(exc, TemplateRenderError)
                                     else "environment")
            metrics["env_errors"] = 1  # counted: agent/env_errors is the share of episodes
            if not prompt_ids:  # reset failed: keep a valid (untrainable) placeholder prompt
                prompt_ids = [self.im_end_id]
            n_model_turns = (tids[-1] + 1) if tids else 0
            rewards = rewards[:n_model_turns] + [0.0] * (n_model_turns - len(rewards))
        finally:
            try:
                await env.close()
            except Exception as exc:  # noqa: BLE001  (closing must not lose the episode)
                metrics["env_close_error"] = f"{type(exc).__name__}: {exc}"
        metrics.update(
            stop_reason=stop,
            num_turns=len(rewards),
            model_tokens=sum(mask),
            env_tokens=len(mask) - sum(mask),
            episode_time_s=time.monotonic() - t0,
            weight_versions=versions,
        )
        label = item.get("label") if isinstance(item, dict) else None
        return Sample(
            prompt_ids=prompt_ids,
            response_ids=resp,
            loss_mask=mask,
            rollout_logprobs=lps if engine_lps else None,
            turn_ids=tids,
            reward=float(sum(rewards)),
            turn_rewards=rewards,
            group_index=group_index,
            index=index,
            finish_reason=finish,
            weight_version=min(versions) if versions else self.engine.weight_version,
            prompt=item,
            label=label,
            metadata=metrics,
        )

    # ------------------------------------------------------------------ many episodes
    async def run_batch(self, items: Sequence[Any], n_per_prompt: int = 1) -> list[Sample]:
        """Play `n_per_prompt` episodes per item, all concurrently (bounded by max_concurrent).

        Returns:
            Samples ordered by item then episode; group_index = item position.
        """
        if n_per_prompt < 1:
            raise ValueError(f"n_per_prompt must be >= 1, got {n_per_prompt}")
        sem = asyncio.Semaphore(self.max_concurrent)

        async def one(i: int, j: int) -> Sample:
            async with sem:
                self._live += 1
                try:
                    return await self.run_episode(
                        items[i], group_index=i, index=i * n_per_prompt + j
                    )
                finally:
                    self._live -= 1
                    self.batcher.poke()

        jobs = [asyncio.ensure_future(one(i, j))
                for i in range(len(items)) for j in range(n_per_prompt)]
        try:
            return list(await asyncio.gather(*jobs))
        except BaseException:  # cancelled (Ctrl-C) or one failed: no episode left running
            for job in jobs:  # once: a second cancel would cut short a job's own cleanup
                if not job.done() and not job.cancelling():
                    job.cancel()
            await asyncio.wait(jobs)
            raise

    def run_batch_sync(self, items: Sequence[Any], n_per_prompt: int = 1) -> list[Sample]:
        """Synchronous `run_batch`, on the engine's own event loop when it has one."""
        runner = getattr(self.engine, "run_coroutine", None) or getattr(self.engine, "_run", None)
        if runner is None:
            return asyncio.run(self.run_batch(items, n_per_prompt))
        return run_cancel_on_interrupt(runner, self.run_batch(items, n_per_prompt))


async def opening_prompt(runner: EpisodeRunner, item: Any) -> list[int]:
    """Token ids of an episode's opening prompt (environment reset, tool list, template)."""
    env = runner.env_factory()
    try:
        messages = await asyncio.wait_for(env.reset(item), runner.limits.episode_timeout_s)
        return runner._encode(runner.chat.session().start(messages, env.tool_schemas()))
    finally:
        await env.close()


class _EngineFailure(Exception):
    """Carries an engine exception through the episode's environment-error handler."""


def _turn_reward(value: Any) -> float:
    """An environment's turn reward as float; ValueError (ends the episode as an environment
    error) for non-numbers, booleans, NaN and infinities."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"environment returned reward {value!r:.40} ({type(value).__name__}); "
                         "expected a finite number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"environment returned reward {out}; expected a finite number")
    if abs(out) > MAX_ABS_REWARD:  # group advantages of such rewards overflow float32
        raise ValueError(f"environment returned reward {out:g}; expected a number within "
                         f"[{-MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}]")
    return out
