"""Benchmark: one learner train_step (GSPO) for a tiny and a small model, single process.

Prints one table: packed tokens per step, tokens/s of the whole step, and the split
forward / backward / optimizer (forward = the training forward + loss without backward, measured
separately; backward = forward_backward - forward), the model FLOP utilisation and the peak
device memory. Runs on the CPU (gloo, CPU compatibility layer) or on one GPU when CUDA is
available.

    python bench/learner_step.py [--steps 3] [--samples 16] [--prompt 32] [--response 96]
    python bench/learner_step.py --models qwen3-0.6b --dtype bfloat16 --samples 32 \
        --prompt 256 --response 768 --microbatches 4          # one GPU, random weights

MFU = 6 x N x tokens / step time / peak dense bf16 FLOP/s of the device, N = every parameter
(a tied embedding counted once), step time = train_step's forward-backward + optimizer. The
6 N rule counts the weight matmuls of forward (2 N) and backward (4 N) only: attention scores
(about 12 x layers x hidden x sequence length per token) and the embedding lookup are left out,
so this MFU slightly understates the work done. Peaks are the vendors' dense bf16 figures
(`PEAK_BF16_TFLOPS`, or `--peak-tflops`); the measured rate of one large bf16 matmul is printed
beside it (`--matmul-probe`) so the MFU can be read against what the device really reaches.
"""

from __future__ import annotations

import argparse
import json
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
    # Qwen3-0.6B's shape (its config.json), random weights: no hub access needed.
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], hidden_size=1024,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, num_hidden_layers=28, vocab_size=151936,
                       rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                       hidden_act="silu", max_position_embeddings=40960),
}

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) from the vendors' datasheets, matched
# against torch.cuda.get_device_name() by substring, first match wins.
PEAK_BF16_TFLOPS = [("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0),
                    ("H20", 148.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0),
                    ("L40S", 362.0), ("A10", 125.0)]


def peak_tflops(device_name: str) -> float | None:
    """The datasheet dense bf16 peak of a device (TFLOP/s), None when it is not in the table."""
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_name:
            return value
    return None


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    """Measured rate (TFLOP/s) of an n x n x n bf16 matmul on the current GPU, mean of `repeats`
    after 3 warm-ups."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)  # [n, n]
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)  # [n, n]
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e12


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

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    learner = Learner(hf, optim=OptimSettings(lr=1e-5), params_dtype=getattr(torch, args.dtype),
                      batching=BatchSettings(num_microbatches=args.microbatches),
                      use_te=(args.spec == "te"))
    samples = make_samples(args.samples, args.prompt, args.response, hf["vocab_size"])
    old = learner.forward_logprobs(samples)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
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
    peak_mem = torch.cuda.max_memory_allocated() if cuda else None
    peak = args.peak_tflops or (peak_tflops(torch.cuda.get_device_name()) if cuda else None)
    mfu = 6 * params * tokens / med(tot) / (peak * 1e12) if peak else None
    del learner, old
    return dict(model=name, params=params, tokens=tokens, tok_s=tokens / med(tot),
                fwd=med(fwd), bwd=max(med(fb) - med(fwd), 0.0), opt=med(opt), step=med(tot),
                mfu=mfu, peak_tflops=peak, peak_mem_gib=None if peak_mem is None
                else peak_mem / 2**30)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-qwen3,small-qwen3,small-qwen3-moe")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=96)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="parameter / compute dtype (default float32)")
    ap.add_argument("--spec", default="local", choices=["local", "te"],
                    help="Megatron layer spec: local (default) or Transformer Engine")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="device peak (TFLOP/s) for the MFU; default: the datasheet table")
    ap.add_argument("--matmul-probe", action="store_true",
                    help="on CUDA, also measure an 8192^3 bf16 matmul's TFLOP/s")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    unknown = [n for n in args.models.split(",") if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    rows = [bench_model(n, MODELS[n], args) for n in args.models.split(",")]
    cuda = torch.cuda.is_available()
    dev = torch.cuda.get_device_name() if cuda else "cpu"
    probe = matmul_tflops() if cuda and args.matmul_probe else None
    print(f"learner train_step (GSPO, {args.dtype}, {args.spec} spec, world size 1, {dev}, "
          f"{args.samples} samples x {args.prompt}+{args.response} tokens, "
          f"{args.microbatches} micro-batches)")
    print(f"{'model':<17}{'params':>13}{'tokens':>8}{'tok/s':>10}{'fwd s':>9}{'bwd s':>9}"
          f"{'opt s':>9}{'step s':>9}{'MFU':>8}{'peak GiB':>10}")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else "n/a"
        print(f"{r['model']:<17}{r['params']:>13,}{r['tokens']:>8}{r['tok_s']:>10.0f}"
              f"{r['fwd']:>9.3f}{r['bwd']:>9.3f}{r['opt']:>9.3f}{r['step']:>9.3f}"
              f"{mfu:>8}{mem:>10}")
    peak = rows[0]["peak_tflops"]
    print("MFU = 6 x params x tokens / step time / peak; peak = "
          + (f"{peak:.0f} TFLOP/s dense bf16 ({'given' if args.peak_tflops else 'datasheet'})"
             if peak else "unknown (CPU or a device not in the table: pass --peak-tflops)"))
    if probe is not None:
        print(f"measured bf16 matmul 8192^3: {probe:.0f} TFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "dtype": args.dtype, "spec": args.spec,
                       "samples": args.samples, "prompt": args.prompt,
                       "response": args.response, "microbatches": args.microbatches,
                       "matmul_tflops": probe, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
