"""Benchmark: one learner train_step (GSPO) for a tiny and a small model, single process.

Prints one table: packed tokens per step, tokens/s of the whole step, and the split
forward / backward / optimizer (forward = the training forward + loss without backward, measured
separately; backward = forward_backward - forward). Runs on the CPU (gloo, CPU compatibility
layer) or on one GPU when CUDA is available.

    python bench/learner_step.py [--steps 3] [--samples 16] [--prompt 32] [--response 96]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

MODELS = {
    "tiny-qwen3": dict(architectures=["Qwen3ForCausalLM"], hidden_size=32, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=64,
                       num_hidden_layers=2, vocab_size=1000, rms_norm_eps=1e-6,
                       rope_theta=1e4, tie_word_embeddings=True, hidden_act="silu",
                       max_position_embeddings=4096),
    "small-qwen3": dict(architectures=["Qwen3ForCausalLM"], hidden_size=256,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                        intermediate_size=768, num_hidden_layers=4, vocab_size=8192,
                        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                        hidden_act="silu", max_position_embeddings=4096),
    "small-qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=256,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                            intermediate_size=768, num_hidden_layers=4, vocab_size=8192,
                            rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                            norm_topk_prob=True, hidden_act="silu",
                            max_position_embeddings=4096),
}


def make_samples(n, prompt, response, vocab, seed=0):
    from megatron_gspo.data.sample import Sample

    rng = random.Random(seed)
    return [Sample(prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                   response_ids=[rng.randrange(vocab) for _ in range(response)],
                   advantage=rng.uniform(-1, 1), index=i) for i in range(n)]


def bench_model(name, hf, args):
    from megatron_gspo.megatron import step
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings

    learner = Learner(hf, optim=OptimSettings(lr=1e-5),
                      batching=BatchSettings(num_microbatches=args.microbatches))
    samples = make_samples(args.samples, args.prompt, args.response, hf["vocab_size"])
    old = learner.forward_logprobs(samples)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fwd, fb, opt, tot = [], [], [], []
    for i in range(args.steps + 1):
        mbs = learner._micro_batches(samples, old)
        data = [step.device_batch(mb, learner.device, learner.ctx) for mb in mbs]
        n_seq = float(len(samples))
        fs = step.forward_step_factory(learner.loss_settings, learner.ctx, num_sequences=n_seq,
                                       num_tokens=1.0, num_microbatches=len(data))
        sync()
        t0 = time.perf_counter()
        learner._run(fs, data, True)
        sync()
        t1 = time.perf_counter()
        m = learner.train_step(samples, old)
        sync()
        if i == 0:
            continue  # warm-up
        fwd.append(t1 - t0)
        fb.append(m["time_fwd_bwd"])
        opt.append(m["time_optimizer"])
        tot.append(m["time_fwd_bwd"] + m["time_optimizer"])
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    params = sum(p.numel() for c in learner.chunks for p in c.parameters())
    med = statistics.median
    return dict(model=name, params=params, tokens=tokens, tok_s=tokens / med(tot),
                fwd=med(fwd), bwd=max(med(fb) - med(fwd), 0.0), opt=med(opt), step=med(tot))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-qwen3,small-qwen3,small-qwen3-moe")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=96)
    ap.add_argument("--microbatches", type=int, default=2)
    args = ap.parse_args()
    rows = [bench_model(n, MODELS[n], args) for n in args.models.split(",")]
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"learner train_step (GSPO, fp32, world size 1, {dev}, {args.samples} samples x "
          f"{args.prompt}+{args.response} tokens, {args.microbatches} micro-batches)")
    print(f"{'model':<17}{'params':>10}{'tokens':>8}{'tok/s':>10}{'fwd s':>9}{'bwd s':>9}"
          f"{'opt s':>9}{'step s':>9}")
    for r in rows:
        print(f"{r['model']:<17}{r['params']:>10,}{r['tokens']:>8}{r['tok_s']:>10.0f}"
              f"{r['fwd']:>9.3f}{r['bwd']:>9.3f}{r['opt']:>9.3f}{r['step']:>9.3f}")


if __name__ == "__main__":
    main()
