"""Single-process Megatron learner checks for multi-turn samples (run by test_learner_agent.py
in its own process, since the learner starts torch.distributed and the CPU compatibility mode).

1. GSPO-token with constant per-episode advantages (expanded by `expand_episode_advantages`)
   equals GSPO in loss and gradients inside the learner.
2. Environment tokens (loss mask 0) receive no gradient: changing the ids of the environment
   tokens that close an episode leaves loss and gradients unchanged, while changing a model
   token's advantage does change them.
Writes {"failures": [...], "info": {...}} as JSON to argv[1].
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_gspo.algo.turn_advantages import assign_multiturn_advantages  # noqa: E402
from megatron_gspo.data.sample import Sample  # noqa: E402

DENSE = dict(architectures=["Qwen3ForCausalLM"], hidden_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=64, num_hidden_layers=2,
             vocab_size=100, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
             hidden_act="silu", max_position_embeddings=256)


def episodes(seed: int = 0, tail_ids: int = 0) -> list[Sample]:
    """Six 2-3 turn episodes in two groups: model turns (mask 1) separated by environment
    tokens (mask 0); every episode ends with 3 environment tokens (ids shifted by tail_ids)."""
    rng = random.Random(seed)
    out = []
    for i in range(6):
        prompt = [rng.randrange(1, 100) for _ in range(rng.randint(3, 6))]
        resp, mask, tids, rewards = [], [], [], []
        n_turns = rng.randint(2, 3)
        for k in range(n_turns):
            n = rng.randint(2, 6)
            resp += [rng.randrange(1, 100) for _ in range(n)]
            mask += [1] * n
            tids += [k] * n
            env = 3 if k == n_turns - 1 else rng.randint(2, 4)
            resp += [(rng.randrange(1, 100) + (tail_ids if k == n_turns - 1 else 0)) % 100
                     for _ in range(env)]
            mask += [0] * env
            tids += [k] * env
            rewards.append(rng.choice([0.0, 0.1, 1.0]))
        out.append(Sample(prompt_ids=prompt, response_ids=resp, loss_mask=mask, turn_ids=tids,
                          turn_rewards=rewards, reward=sum(rewards), group_index=i // 3,
                          index=i))
    return out


def main() -> None:
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.step import LossSettings

    failures: list[str] = []
    info: dict = {}

    def close(what, a, b, rtol=1e-5, atol=1e-8):
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        err, ref = (a - b).norm().item(), b.norm().item()
        if not err <= rtol * ref + atol:
            failures.append(f"{what}: |diff|={err:.3e} |ref|={ref:.3e}")
        return err

    def grads_close(what, g, h):
        for k in g:
            close(f"{what}[{k}]", g[k], h[k])

    L = Learner(DENSE, batching=BatchSettings(num_microbatches=1), seed=7)
    samples = episodes()
    lps = L.forward_logprobs(samples)
    g = torch.Generator().manual_seed(1)
    old = [[x + 2e-3 * float(torch.randn((), generator=g)) for x in lp] for lp in lps]

    # 1. GSPO == GSPO-token with constant per-episode advantages
    assign_multiturn_advantages(samples, mode="episode")
    token_adv = [list(s.advantage) for s in samples]
    L.loss_settings = LossSettings(kind="gspo")
    for s in samples:
        s.advantage = next(a for a, m in zip(s.advantage, s.loss_mask, strict=True) if m)
    m_seq = L.forward_backward(samples, old)
    g_seq = L.full_grads()
    L.loss_settings = LossSettings(kind="gspo_token")
    for s, a in zip(samples, token_adv, strict=True):
        s.advantage = a
    m_tok = L.forward_backward(samples, old)
    g_tok = L.full_grads()
    info["loss_gspo"], info["loss_gspo_token"] = m_seq["loss"], m_tok["loss"]
    info["clip_fraction"] = m_seq["clip_fraction"]
    # float32 sums of O(1) terms that cancel (centred advantages): compare absolutely
    close("loss gspo vs gspo_token", m_tok["loss"], m_seq["loss"], rtol=0.0, atol=1e-6)
    grads_close("grad gspo vs gspo_token", g_tok, g_seq)
    if sum(v.norm().item() for v in g_seq.values()) == 0:
        failures.append("GSPO gradients are all zero")

    # 2. environment tokens get no gradient (turn-level advantages, GSPO-token)
    assign_multiturn_advantages(samples, mode="turn", gamma=0.9)
    m_a = L.forward_backward(samples, old)
    g_a = L.full_grads()
    other = episodes(tail_ids=37)  # same episodes, other closing environment tokens
    if [s.loss_mask for s in other] != [s.loss_mask for s in samples]:
        failures.append("episode layouts differ")
    assign_multiturn_advantages(other, mode="turn", gamma=0.9)
    old_other = [list(o) for o in old]  # pi_old of masked tokens is never used
    m_b = L.forward_backward(other, old_other)
    g_b = L.full_grads()
    close("loss with other environment tokens", m_b["loss"], m_a["loss"], rtol=0.0, atol=1e-9)
    grads_close("grad with other environment tokens", g_b, g_a)
    # sanity: a model token's advantage does move the gradients
    samples[0].advantage = [a * 3.0 for a in samples[0].advantage]
    L.forward_backward(samples, old)
    moved = sum((v - g_a[k]).norm().item() for k, v in L.full_grads().items())
    info["grad_change_from_model_token_advantage"] = moved
    if moved <= 1e-6:
        failures.append("changing a model token advantage did not change the gradients")

    Path(sys.argv[1]).write_text(json.dumps({"failures": failures, "info": info}))
    L.shutdown()


if __name__ == "__main__":
    main()
