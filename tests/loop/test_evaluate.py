"""Evaluation of the plain (single-turn) loop: one response per prompt at
`train.eval_temperature` (0 = greedy), scored with the run's reward."""

from pathlib import Path

import pytest

from megatron_gspo.loop import build, phases
from megatron_gspo.config import load_config
from megatron_gspo.data.datasets import PromptItem
from tests.agent.agent_helpers import ScriptedEngine

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_evaluate_samples_once_per_prompt_at_the_eval_temperature(temperature):
    cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml",
                      [f"train.eval_temperature={temperature}"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "examples" / "tiny" / "base")
    answers = {1: "46", 2: "13"}  # prompt id -> response; the labels are 46 and 12
    seen = []

    class Recording(ScriptedEngine):
        async def agenerate(self, requests):
            seen.extend((r.sampling.temperature, r.sampling.n) for r in requests)
            return await super().agenerate(requests)

    engine = Recording(lambda ids, _: tok.encode(answers[ids[0]] + "<|im_end|>",
                                                 add_special_tokens=False))
    prompts = [PromptItem(prompt_ids=[1], prompt="What is 12+34?", label="46", row=0),
               PromptItem(prompt_ids=[2], prompt="What is 5+7?", label="12", row=1)]
    m = phases.evaluate(cfg, engine, tok, build.reward_scorer(cfg, tok), prompts)
    assert m == {"eval/reward_mean": 0.5, "eval/prompts": 2.0, "eval/mean@1": 0.5,
                 "eval/pass@1": 0.5}
    assert seen == [(temperature, 1), (temperature, 1)]
