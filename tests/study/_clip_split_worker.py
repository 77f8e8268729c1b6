"""Runs in its own process (the learner starts torch.distributed and the CPU layer): engine and
learner agree (fp32 both) except on chosen sequences whose engine log-probs are shifted; with the
engine's log-probs as pi_old, the first mini-batch clips exactly those. Prints one JSON line for
tests/study/test_clip_split.py."""

import json
import sys
import tempfile

import torch

SHIFT = 0.5  # per-token log-prob shift of the chosen sequences: ratio e^0.5 / e^-0.5
PROMPTS, GROUP, MINI_BATCHES = 4, 4, 2


def tiny_model_dir() -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hc = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2,
                     pad_token_id=3, rms_norm_eps=1e-6)
    d = tempfile.mkdtemp()
    Qwen3ForCausalLM(hc).save_pretrained(d)
    return d


def _adv(s) -> float:
    a = s.advantage
    return float(a[0]) if isinstance(a, list) else float(a)


def main() -> None:
    from megatron_gspo.loop import build, phases
    from megatron_gspo.loop import weight_sync_phase as sync_phase
    from megatron_gspo.config import load_config
    from megatron_gspo.megatron.step import LossSettings
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    d = tiny_model_dir()
    base = [f"model.path={d}", "model.dtype=float32", "rollout.dtype=float32",
            "optimizer.lr=1e-3", f"rollout.group_size={GROUP}",
            f"train.prompts_per_step={PROMPTS}", f"algorithm.mini_batches={MINI_BATCHES}",
            "rollout.max_new_tokens=16", "algorithm.micro_batch_tokens=100000",
            "precision.old_logprobs=rollout"]
    cfg = load_config(None, base)
    hf = build.read_hf_config(d)
    learner = build.learner(cfg, hf)
    build.load_initial_weights(cfg, learner, hf)
    engine = EmbeddedEngine(dict(hf), dtype="float32", seed=1)
    g = torch.Generator().manual_seed(5)
    reqs = [GenerateRequest(prompt_ids=torch.randint(10, 250, (6,), generator=g).tolist(),
                            sampling=SamplingParams(max_new_tokens=5 + 3 * j, temperature=1.0,
                                                    n=GROUP))
            for j in range(PROMPTS)]  # groups of different lengths: shares tell sequences apart
    out = {}
    cases = [("gspo", "rollout"), ("gspo_token", "rollout"), ("grpo", "rollout"),
             ("gspo", "recompute")]
    for step, (kind, source) in enumerate(cases):
        cfg = load_config(None, base + [f"algorithm.loss={kind}"])
        lo, hi = cfg.algorithm.clip_range()
        learner.loss_settings = LossSettings(kind=kind, eps_low=lo, eps_high=hi)
        sync_phase.sync_weights(learner, engine, hf, cfg, version=step)  # engine = learner weights
        samples = engine.generate(reqs)
        for i, s in enumerate(samples):
            s.reward = float(i % GROUP)  # distinct rewards in each group: no zero advantage
        phases.fill_advantages(cfg, samples)
        parts = phases.minibatch_parts(len(samples), MINI_BATCHES, cfg.train.seed, step)
        chosen = parts[0][:2] + parts[1][:1]  # two sequences in mini-batch 0, one in 1
        for i in chosen:  # the engine "disagrees" on these: ratios pushed past the clip range
            s = samples[i]
            sign = 1.0 if _adv(s) > 0 else -1.0
            s.rollout_logprobs = [lp - sign * SHIFT * m for lp, m in
                                  zip(s.rollout_logprobs, s.loss_mask, strict=True)]
        old = learner.forward_logprobs(samples) if source == "recompute" else None
        m = phases.train_on_batch(cfg, learner, samples, old, step)

        def share(idx, sel, samples=samples):
            tok = sum(samples[i].num_trainable for i in idx)
            return sum(samples[i].num_trainable for i in idx if i in sel) / tok

        out[f"{kind}/{source}"] = {
            "first": m["clip_fraction/first_minibatch"],
            "later": m["clip_fraction/later_minibatches"],
            "mb": [m[f"clip_fraction/minibatch_{j}"] for j in range(MINI_BATCHES)],
            "expected_first": share(parts[0], set(chosen)),
            "expected_later_from_mismatch": share(parts[1], set(chosen)),
            "clip_fraction": m["clip_fraction"], "ratio_spread": m["ratio/spread"],
        }
    learner.shutdown()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
