"""Episode runner on the real embedded engine with a tiny random Qwen3 model.

The learner's teacher-forced log-probs of the episode's model tokens must equal the engine's
sampling log-probs: the trained sequence is exactly what the engine generated and conditioned on.
"""

import pytest
import torch

from megatron_gspo.agent.env import StepResult, ToolEnvironment
from megatron_gspo.agent.runner import EpisodeLimits, EpisodeRunner
from megatron_gspo.rollout.engine import SamplingParams
from megatron_gspo.rollout.embedded import EmbeddedEngine, sequence_logprobs
from tests.agent.agent_helpers import ToyTokenizer

TOK = ToyTokenizer()


class ChattyEnv(ToolEnvironment):
    """Replies to every turn and ends after three; reward = turn index."""

    def first_messages(self, sample):
        self.turn = 0
        return [{"role": "user", "content": sample["prompt"]}]

    async def step(self, action):
        self.turn += 1
        obs = [{"role": "tool", "content": f"seen {len(action)} chars"}]
        return StepResult(obs, float(self.turn), self.turn >= 3, {"chars": len(action)})


@pytest.fixture(scope="module")
def engine():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=len(TOK), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=512, eos_token_id=TOK.ids["<|im_end|>"],
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    # an output bias towards the end-of-turn token keeps the random model's turns short
    head = torch.nn.Linear(32, len(TOK), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[TOK.ids["<|im_end|>"]] = 3.5
    model.lm_head = head
    eng = EmbeddedEngine(model, dtype="float32", seed=1)
    yield eng
    eng.shutdown()


def test_embedded_episode_tokens_match_learner_logprobs(engine):
    runner = EpisodeRunner(
        engine, TOK, ChattyEnv, sampling=SamplingParams(max_new_tokens=48, temperature=1.0),
        limits=EpisodeLimits(max_turns=3, max_new_tokens_per_turn=48, max_total_tokens=400),
        enable_thinking=True, batch_wait_s=0.05,
    )
    rows = [{"prompt": "hi"}, {"prompt": "add 2 and 3"}]
    samples = runner.run_batch_sync(rows, n_per_prompt=3)
    assert len(samples) == 6 and max(runner.batcher.batch_sizes) > 1
    n_multi = 0
    for s in samples:
        s.validate()
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert mask.any()
        learner = sequence_logprobs(engine.model, s.prompt_ids, s.response_ids)  # [R]
        engine_lp = torch.tensor(s.rollout_logprobs)
        assert torch.allclose(learner[mask], engine_lp[mask], atol=1e-4), s.index
        assert (engine_lp[~mask] == 0).all()
        if (~mask).any():
            n_multi += 1
            assert len(s.turn_rewards) == max(s.turn_ids) + 1
    assert n_multi >= 1  # at least one episode went past its first turn
