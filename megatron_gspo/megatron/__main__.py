"""Learner smoke run: random weights, synthetic samples, a few GSPO steps on any layout.

    torchrun --nproc_per_node=4 -m megatron_gspo.megatron --hf-config config.json --tp 2 --pp 2
    python -m megatron_gspo.megatron --hf-config config.json          # one process

Prints one metrics line per step on rank 0 (loss, clip fraction, grad norm, lr, tokens/s).
"""

from __future__ import annotations

import argparse
import json
import random

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _samples(n, prompt, response, vocab, seed):
    from megatron_gspo.data.sample import Sample

    rng = random.Random(seed)
    return [Sample(prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                   response_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, response))],
                   advantage=rng.uniform(-1, 1), index=i) for i in range(n)]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m megatron_gspo.megatron",
                                 description="Megatron-Core GSPO learner smoke run")
    ap.add_argument("--hf-config", required=True, help="path to a Hugging Face config.json")
    for flag in ("tp", "pp", "ep", "cp"):
        ap.add_argument(f"--{flag}", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--sp", action="store_true", help="sequence parallel")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=48)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from megatron_gspo.megatron.learner import BatchSettings, Learner, broadcast_samples
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.parallel import ParallelLayout

    with open(args.hf_config) as f:
        hf = json.load(f)
    layout = ParallelLayout(tensor=args.tp, pipeline=args.pp, virtual_pipeline=args.vpp,
                            expert=args.ep, expert_tensor=args.etp, context=args.cp,
                            sequence_parallel=args.sp)
    learner = Learner(hf, layout=layout, params_dtype=DTYPES[args.dtype],
                      optim=OptimSettings(lr=args.lr,
                                          use_distributed_optimizer=args.distributed_optimizer),
                      batching=BatchSettings(num_microbatches=args.microbatches))
    rank0 = dist.get_rank() == 0
    for i in range(args.steps):
        samples = broadcast_samples(
            _samples(args.samples, args.prompt_len, args.response_len, hf["vocab_size"], i)
            if rank0 else None)
        old = learner.forward_logprobs(samples)
        m = learner.train_step(samples, old)
        if rank0:
            print(f"step {i}: loss={m['loss']:.6f} clip={m['clip_fraction']:.4f} "
                  f"grad_norm={m['grad_norm']:.4f} lr={m['lr']:.2e} "
                  f"tokens/s={m['tokens_per_s']:.0f}", flush=True)
    learner.shutdown()


if __name__ == "__main__":
    main()
