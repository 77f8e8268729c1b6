"""The multi-turn agent example: configs load, the environment resolves from its file path, and
a reference episode replayed through the runner has exactly the pre-training token layout."""

import random
import sys
from pathlib import Path

import pytest

from megatron_gspo.agent import build_runner, resolve_env
from megatron_gspo.config import load_config
from megatron_gspo.rollout.engine import SamplingParams
from tests.agent.agent_helpers import ScriptedEngine

EX = Path(__file__).resolve().parents[2] / "examples" / "multiturn_agent"
sys.path.insert(0, str(EX))
import task  # noqa: E402
from pretrain import encode_episode  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return task.build_tokenizer()


@pytest.mark.parametrize("name", ["config_cpu.yaml", "config_gpu.yaml"])
def test_configs_load_and_environment_resolves(name):
    cfg = load_config(EX / name)
    assert cfg.agent.enabled and cfg.algorithm.loss == "gspo_token"
    cls = resolve_env(str(EX / "env.py") + ":ArithmeticAgentEnv")
    assert cls.__name__ == "ArithmeticAgentEnv"
    if cfg.agent.environment == "calculator":
        assert resolve_env("calculator").__name__ == "CalculatorEnv"


def test_reference_episode_replay_matches_pretraining_layout(tok):
    rows = [task.make_problem(random.Random(f"t{i}")) for i in range(3)]
    by_prompt = {}
    for row in rows:
        pieces = [tok.encode(t, add_special_tokens=False) for t, m in task.reference_episode(row)
                  if m]
        by_prompt[row["prompt"]] = pieces

    def script(prompt_ids, _n):
        text = tok.decode(prompt_ids)
        row_prompt = next(p for p in by_prompt if p in text)
        turn = text.count("<|im_start|>assistant") - 1
        return by_prompt[row_prompt][turn]

    eng = ScriptedEngine(script)
    runner = build_runner(
        eng, tok, environment=f"{EX / 'env.py'}:ArithmeticAgentEnv",
        sampling=SamplingParams(max_new_tokens=96), max_turns=3, max_total_tokens=320,
        max_new_tokens_per_turn=96,
    )
    for row, s in zip(rows, runner.run_batch_sync(rows), strict=True):
        ids, mask = encode_episode(tok, row)
        assert s.tokens == ids
        assert [0] * len(s.prompt_ids) + s.loss_mask == mask
        assert s.turn_rewards == pytest.approx([0.1, 1.0]) and s.metadata["correct"] == 1
        assert len(ids) <= 320


def _reference_script(tok, rows, answers_right):
    """ScriptedEngine policy: the reference tool call on the first turn; then the reference
    answer where answers_right(row, call_no), else "0"."""

    def script(prompt_ids, call_no):
        text = tok.decode(prompt_ids)
        row = next(r for r in rows if r["prompt"] in text)
        pieces = [tok.encode(t, add_special_tokens=False)
                  for t, m in task.reference_episode(row) if m]
        if text.count("<|im_start|>assistant") == 1:
            return pieces[0]
        if answers_right(row, call_no):
            return pieces[1]
        return tok.encode("0<|im_end|>", add_special_tokens=False)

    return script


def test_loop_glue_rollout_and_turn_advantages(tok):
    from megatron_gspo.agent.loop import fill_turn_advantages, rollout_episodes
    from megatron_gspo.rollout.engine import GenerateRequest

    cfg = load_config(EX / "config_cpu.yaml", ["train.prompts_per_step=2", "rollout.group_size=3",
                                               f"agent.environment={EX / 'env.py'}:"
                                               "ArithmeticAgentEnv"])
    rows = [task.make_problem(random.Random(f"g{i}")) for i in range(3)]
    reqs = iter([GenerateRequest(prompt_ids=[1], prompt=r["prompt"], label=r["label"],
                                 metadata={"row": i}) for i, r in enumerate(rows)])

    script = _reference_script(tok, rows, answers_right=lambda row, call_no: call_no % 2)

    samples, metrics = rollout_episodes(cfg, ScriptedEngine(script), reqs, tok, step=0)
    assert len(samples) == 6 and [s.group_index for s in samples] == [0, 0, 0, 1, 1, 1]
    assert [s.index for s in samples] == list(range(6))
    assert next(reqs).metadata["row"] == 2  # only prompts_per_step requests were taken
    assert {round(s.reward, 6) for s in samples} == {0.1, 1.1}
    assert metrics["agent/tool_calls"] == 1.0 and 0 < metrics["agent/correct"] < 1
    fill_turn_advantages(cfg, samples)
    for s in samples:
        assert len(s.advantage) == len(s.response_ids)
        assert all(a == 0.0 for a, m in zip(s.advantage, s.loss_mask, strict=True) if m == 0)
    bad = load_config(EX / "config_cpu.yaml", ["data.apply_chat_template=true"])
    with pytest.raises(ValueError, match="data.apply_chat_template"):
        rollout_episodes(bad, ScriptedEngine(script), iter([]), tok, step=0)


def test_shipped_base_tokenizer_and_config():
    import json as _json

    from transformers import AutoTokenizer

    base = EX / "base"
    shipped = AutoTokenizer.from_pretrained(base)
    fresh = task.build_tokenizer()
    text = task.reference_episode(task.make_problem(random.Random("b")))[1][0]
    assert shipped.encode(text, add_special_tokens=False) == fresh.encode(
        text, add_special_tokens=False)
    for special in ("<tool_call>", "</tool_call>", "<|im_end|>"):
        assert len(shipped.encode(special, add_special_tokens=False)) == 1
    cfg = _json.loads((base / "config.json").read_text())
    assert cfg["vocab_size"] == task.VOCAB_SIZE and cfg["max_position_embeddings"] >= 320


def test_evaluation_plays_one_episode_per_prompt(tok):
    from megatron_gspo.loop import phases
    from megatron_gspo.data.datasets import PromptItem

    cfg = load_config(EX / "config_cpu.yaml", ["train.eval_temperature=0.5",
                                               f"agent.environment={EX / 'env.py'}:"
                                               "ArithmeticAgentEnv"])
    rows = [task.make_problem(random.Random(f"e{i}")) for i in range(4)]
    temps = []

    # rows 0 and 1 answer right, rows 2 and 3 wrong
    script = _reference_script(tok, rows, answers_right=lambda row, _: rows.index(row) < 2)

    class Recording(ScriptedEngine):
        async def agenerate(self, requests):
            temps.extend(r.sampling.temperature for r in requests)
            return await super().agenerate(requests)

    prompts = [PromptItem(prompt=r["prompt"], prompt_ids=[1], label=r["label"], row=i)
               for i, r in enumerate(rows)]
    m = phases.evaluate(cfg, Recording(script), tok, None, prompts)
    assert m["eval/prompts"] == 4.0
    assert m["eval/reward_mean"] == pytest.approx((1.1 + 1.1 + 0.1 + 0.1) / 4)
    assert m["eval/agent/correct"] == 0.5
    assert temps and set(temps) == {0.5}
