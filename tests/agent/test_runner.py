"""Episode runner with a scripted engine: exact tokens, masks, stops, tool errors, batching."""

import asyncio
import re

import pytest

from megatron_gspo.agent.env import StepResult, ToolEnvironment
from megatron_gspo.agent.envs import CalculatorEnv
from megatron_gspo.agent.runner import EpisodeLimits, EpisodeRunner, episode_metrics
from megatron_gspo.agent.tools import Calculator, ToolSet
from megatron_gspo.rollout.engine import RolloutError, SamplingParams
from tests.agent.agent_helpers import SPECIALS, ScriptedEngine, ToyTokenizer

TOK = ToyTokenizer()
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


def split_ids(text):
    """Specials as single tokens, everything else one character per token (never merges)."""
    out = []
    for piece in re.split("(" + "|".join(re.escape(s) for s in SPECIALS) + ")", text):
        if piece in SPECIALS:
            out.append(TOK.ids[piece])
        else:
            out += [TOK.ids[c] for c in piece]
    return out


def turn_of(prompt_ids):
    return TOK.decode(prompt_ids).count("<|im_start|>assistant") - 1


def script_from(turns):
    """Engine script: the text of turn k (formatted with the question's numbers)."""

    def script(prompt_ids, _call_no):
        text = TOK.decode(prompt_ids)
        a, b = map(int, re.search(r"What is (\d+)\*(\d+)", text).groups())
        k = turn_of(prompt_ids)
        text = turns[min(k, len(turns) - 1)]
        for key, val in (("{ab}", a * b), ("{a}", a), ("{b}", b)):
            text = text.replace(key, str(val))
        return split_ids(text)

    return script


ROWS = [{"prompt": "What is 12*3?", "label": "36"}, {"prompt": "What is 7*12?", "label": "84"}]
GOOD = [CALL % "{a}*{b}", "The answer is {ab}.<|im_end|>"]


def make_runner(engine, env_factory=None, **limits):
    return EpisodeRunner(
        engine, TOK, env_factory or (lambda: CalculatorEnv(tool_call_reward=0.25)),
        sampling=SamplingParams(max_new_tokens=64, temperature=1.0),
        limits=EpisodeLimits(**{"max_new_tokens_per_turn": 200, **limits}),
        enable_thinking=True,
    )


def test_trajectory_tokens_masks_and_rewards():
    eng = ScriptedEngine(script_from(GOOD))
    samples = make_runner(eng).run_batch_sync(ROWS, n_per_prompt=2)
    assert [(s.group_index, s.index) for s in samples] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert len(eng.calls) == 8
    for s in samples:
        toks = s.tokens
        s.validate()
        assert s.finish_reason == "stop" and s.metadata["stop_reason"] == "done"
        assert s.turn_rewards == [0.25, 1.0] and s.reward == 1.25
        assert s.metadata["tool_calls"] == 1 and s.metadata["correct"] == 1
        # every engine call of this episode: its prompt is exactly the sequence so far
        # (token in) and its output sits unchanged at the next positions with mask 1 (token out)
        mine = sorted({(tuple(p), tuple(r)) for p, r in eng.calls
                       if toks[: len(p) + len(r)] == p + r}, key=lambda c: len(c[0]))
        mine = [(list(p), list(r)) for p, r in mine]
        assert len(mine) == 2 and mine[0][0] == s.prompt_ids
        model_pos = []
        for k, (p, r) in enumerate(mine):
            off = len(p) - len(s.prompt_ids)
            span = range(off, off + len(r))
            model_pos += list(span)
            assert [s.loss_mask[t] for t in span] == [1] * len(r)
            assert [s.turn_ids[t] for t in span] == [k] * len(r)
            want_lp = [-(0.01 * (t + 1) + 0.001 * (len(p) % 100)) for t in range(len(r))]
            assert [s.rollout_logprobs[t] for t in span] == pytest.approx(want_lp)
        assert sorted(model_pos) == [t for t, m in enumerate(s.loss_mask) if m == 1]
        # environment tokens: mask 0, log-prob 0.0, the tool response turn
        env_pos = [t for t, m in enumerate(s.loss_mask) if m == 0]
        assert all(s.rollout_logprobs[t] == 0.0 for t in env_pos)
        env_text = TOK.decode([s.response_ids[t] for t in env_pos])
        a, b = map(int, re.search(r"(\d+)\*(\d+)", s.prompt["prompt"]).groups())
        assert env_text == (f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{a * b}\n"
                            "</tool_response><|im_end|>\n<|im_start|>assistant\n")
        # the model's spelling is kept: re-tokenising its text would give other ids
        model_ids = [s.response_ids[t] for t in model_pos]
        assert TOK.encode(TOK.decode(model_ids)) != model_ids
    m = episode_metrics(samples)
    assert m["agent/reward"] == 1.25 and m["agent/stop/done"] == 1.0 and m["agent/num_turns"] == 2
    assert max(eng.batch_sizes) == 4  # the 4 concurrent episodes were batched


def test_unbatched_requests_give_the_same_episodes():
    eng = ScriptedEngine(script_from(GOOD))
    runner = make_runner(eng)
    runner.batch_requests = False
    samples = runner.run_batch_sync(ROWS, n_per_prompt=2)
    assert set(eng.batch_sizes) == {1} and len(eng.calls) == 8
    ref = make_runner(ScriptedEngine(script_from(GOOD))).run_batch_sync(ROWS, n_per_prompt=2)
    for a, b in zip(samples, ref, strict=True):
        assert a.tokens == b.tokens and a.loss_mask == b.loss_mask and a.reward == b.reward


def test_runner_reusable_across_event_loops():
    eng = ScriptedEngine(script_from(GOOD))
    runner = make_runner(eng)
    first = asyncio.run(runner.run_batch(ROWS, 2))
    second = asyncio.run(runner.run_batch(ROWS, 2))
    assert [s.tokens for s in first] == [s.tokens for s in second]


def test_closed_turn_gets_no_extra_end_marker():
    eng = ScriptedEngine(script_from([CALL % "{a}*{b}" + "<|im_end|>", "{ab}<|im_end|>"]))
    runner = make_runner(eng)
    runner.stop_token_ids = (TOK.ids["<|im_end|>"],)  # do not stop at </tool_call>
    s = runner.run_batch_sync(ROWS[:1])[0]
    env_text = TOK.decode([t for t, m in zip(s.response_ids, s.loss_mask, strict=False) if m == 0])
    assert env_text.startswith("\n<|im_start|>user\n<tool_response>")
    assert s.reward == 1.25


def test_max_turns_and_max_total_tokens():
    eng = ScriptedEngine(script_from([CALL % "{a}*{b}"]))  # never answers
    s = make_runner(eng, max_turns=3).run_batch_sync(ROWS[:1])[0]
    assert s.finish_reason == "length" and s.metadata["stop_reason"] == "max_turns"
    assert s.turn_rewards == [0.25] * 3 and max(s.turn_ids) == 2
    assert s.loss_mask[-1] == 1  # nothing appended after the last model turn
    s = make_runner(eng, max_turns=10, max_total_tokens=len(s.prompt_ids) + 150).run_batch_sync(
        ROWS[:1])[0]
    assert s.metadata["stop_reason"] == "max_total_tokens" and s.finish_reason == "length"
    assert len(s.tokens) <= len(s.prompt_ids) + 150
    assert len(s.turn_rewards) == max(s.turn_ids) + 1


def test_total_budget_truncation_and_missing_logprobs():
    eng = ScriptedEngine(script_from(GOOD))
    runner = make_runner(eng)
    prompt_len = len(runner.run_batch_sync(ROWS[:1])[0].prompt_ids)
    s = make_runner(eng, max_total_tokens=prompt_len + 12).run_batch_sync(ROWS[:1])[0]
    assert s.metadata["stop_reason"] == "max_total_tokens" and len(s.response_ids) == 12

    class NoLogprobs(ScriptedEngine):
        async def agenerate(self, requests):
            out = await super().agenerate(requests)
            for o in out:
                o.rollout_logprobs = None
            return out

    s = make_runner(NoLogprobs(script_from(GOOD))).run_batch_sync(ROWS[:1])[0]
    assert s.rollout_logprobs is None and s.reward == 1.25


def test_turn_truncated_by_max_new_tokens():
    eng = ScriptedEngine(script_from(GOOD))
    s = make_runner(eng, max_new_tokens_per_turn=10).run_batch_sync(ROWS[:1])[0]
    assert s.finish_reason == "length" and s.metadata["stop_reason"] == "turn_length"
    assert s.response_ids == eng.calls[0][1] and len(s.response_ids) == 10
    assert s.turn_rewards == [0.0] and s.loss_mask == [1] * 10


def test_bad_tool_calls_are_observations_and_counted():
    class Slow:
        name, description, parameters = "slow", "sleeps", {"type": "object"}

        async def __call__(self, arguments):
            await asyncio.sleep(3)
            return ""

    class Huge:
        name, description, parameters = "huge", "floods", {"type": "object"}

        async def __call__(self, arguments):
            return "z" * 50_000

    def env():
        e = CalculatorEnv(tool_error_reward=-0.1)
        e.tools = ToolSet([Calculator(), Slow(), Huge()], timeout_s=0.2, max_output_chars=64)
        return e

    turns = [
        "<tool_call>{oops</tool_call>",
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "slow", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "huge", "arguments": {}}</tool_call>',
        CALL % "1/0",
        "{ab}<|im_end|>",
    ]
    eng = ScriptedEngine(script_from(turns))
    s = make_runner(eng, env, max_turns=8, max_total_tokens=4000).run_batch_sync(ROWS[:1])[0]
    md = s.metadata
    assert s.finish_reason == "stop" and md["num_turns"] == 6 and s.reward > 0
    assert md["tool_errors/invalid_call"] == 1 and md["tool_errors/unknown_tool"] == 1
    assert md["tool_errors/timeout"] == 1 and md["tool_errors/tool_error"] == 1
    assert md["tool_outputs_truncated"] == 1
    assert s.turn_rewards == pytest.approx([-0.1, -0.1, -0.1, 0.0, -0.1, 1.0])
    env_text = TOK.decode([t for t, m in zip(s.response_ids, s.loss_mask, strict=False) if m == 0])
    assert "Error: invalid JSON" in env_text and "unknown tool 'search'" in env_text
    assert "timed out" in env_text and "output truncated" in env_text
    assert "division by zero" in env_text
    agg = episode_metrics([s])
    assert agg["agent/tool_errors/timeout"] == 1.0


def test_timeouts():
    eng = ScriptedEngine(script_from(GOOD), delay_s=0.5)
    s = make_runner(eng, turn_timeout_s=0.1).run_batch_sync(ROWS[:1])[0]
    assert s.finish_reason == "abort" and s.metadata["stop_reason"] == "turn_timeout"
    assert s.response_ids == [] and s.turn_rewards == []

    class SlowEnv(CalculatorEnv):
        async def step(self, action):
            await asyncio.sleep(0.3)
            return await super().step(action)

    eng = ScriptedEngine(script_from([CALL % "{a}*{b}"]))
    s = make_runner(eng, SlowEnv, max_turns=10, episode_timeout_s=0.5).run_batch_sync(ROWS[:1])[0]
    assert s.finish_reason == "abort" and s.metadata["stop_reason"] == "episode_timeout"
    assert len(s.turn_rewards) == max(s.turn_ids) + 1 and s.metadata["episode_time_s"] < 1.0


def test_environment_failure_ends_only_its_episode_engine_failure_raises():
    class Broken(ToolEnvironment):
        def first_messages(self, sample):
            return [{"role": "user", "content": sample["prompt"]}]

        async def step(self, action):
            if "7" in self.sample["prompt"]:
                raise RuntimeError("env bug")
            return StepResult([], 1.0, True)

    eng = ScriptedEngine(script_from(GOOD))
    a, b = make_runner(eng, Broken).run_batch_sync(ROWS)
    assert a.finish_reason == "stop" and a.reward == 1.0
    assert b.finish_reason == "abort" and b.metadata["env_error"] == "RuntimeError: env bug"
    assert b.turn_rewards == [0.0] and b.loss_mask and all(b.loss_mask)
    eng.fail = RolloutError("server down")
    with pytest.raises(RolloutError, match="server down"):
        make_runner(eng).run_batch_sync(ROWS)


def test_limits_validation():
    with pytest.raises(ValueError, match="agent.max_turns must be >= 1"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(ValueError, match="agent.turn_timeout_s must be > 0"):
        EpisodeLimits(turn_timeout_s=0)
