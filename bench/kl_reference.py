"""Benchmark: the pi_old + KL-reference log-prob phase of one RL step, as two passes over the
batch (`forward_logprobs` of the policy, then of the reference: two pipeline schedules, two
packings) vs one pipeline schedule running both models per micro-batch
(`forward_logprobs_with_reference`). Same model, same batch, one process, alternating repeats,
median; the two results are checked to be identical.

    python bench/kl_reference.py [--repeats 7] [--size tiny|small]
    torchrun --nproc_per_node 2 bench/kl_reference.py --pipeline 2     # (or --tensor 2)

The compute (one forward of each model) is the same in both; what one schedule saves is the
second packing / schedule set-up / result gather (and, under pipeline parallelism, a second
pipeline fill and drain). The last line is `ratio=<one schedule / two passes>`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.old_logprobs import SIZES, random_qwen3  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--response-tokens", type=int, default=64)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--pipeline", type=int, default=1)
    ap.add_argument("--tensor", type=int, default=1)
    args = ap.parse_args()

    import torch.distributed as dist

    from megatron_gspo.loop import build
    from megatron_gspo.config import load_config
    from megatron_gspo.data.sample import Sample

    d = random_qwen3(args.size)  # every rank saves the same seeded model into its own folder
    cfg = load_config(None, [f"model.path={d}", "model.dtype=float32", "algorithm.kl_coef=0.05",
                             f"algorithm.micro_batch_tokens={args.micro_batch_tokens}",
                             f"parallel.pipeline={args.pipeline}",
                             f"parallel.tensor={args.tensor}"])
    hf = build.read_hf_config(d)
    learner = build.learner(cfg, hf)
    build.load_initial_weights(cfg, learner, hf)
    build.load_reference(cfg, learner, hf)
    rng = random.Random(0)
    samples = [Sample(prompt_ids=[rng.randrange(10, SIZES[args.size]["vocab_size"])
                                  for _ in range(args.prompt_tokens)],
                      response_ids=[rng.randrange(10, SIZES[args.size]["vocab_size"])
                                    for _ in range(rng.randint(args.response_tokens // 2,
                                                               args.response_tokens))],
                      index=i)
               for i in range(args.sequences)]
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)

    def two_passes():
        return learner.forward_logprobs(samples), learner.forward_logprobs(samples,
                                                                           reference=True)

    def one_schedule():
        return learner.forward_logprobs_with_reference(samples)

    if two_passes() != one_schedule():
        raise SystemExit("one schedule and two passes disagree")
    times: dict[str, list[float]] = {"two passes": [], "one schedule": []}
    for _ in range(args.repeats):
        for name, fn in (("two passes", two_passes), ("one schedule", one_schedule)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    if dist.get_rank() != 0:
        learner.shutdown()
        return
    print(f"model={args.size} sequences={args.sequences} tokens={tokens} "
          f"micro_batch_tokens={args.micro_batch_tokens} repeats={args.repeats} "
          f"tp={args.tensor} pp={args.pipeline}")
    print(f"{'pi_old + reference':>18} | {'median s':>9} | {'min s':>7} | {'max s':>7}")
    for k, v in times.items():
        print(f"{k:>18} | {med[k]:>9.3f} | {min(v):>7.3f} | {max(v):>7.3f}")
    learner.shutdown()
    print(f"ratio={med['one schedule'] / med['two passes']:.3f}")


if __name__ == "__main__":
    main()
