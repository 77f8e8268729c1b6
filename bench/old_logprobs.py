"""Benchmark: training-phase time of one GSPO RL step with pi_old recomputed by the learner
(`recompute`: one no-grad forward over the batch + 4 mini-batch optimizer steps) vs taken from
the rollout engine (`rollout`: the 4 optimizer steps only). Same model, same data, one process,
alternating repeats, median. Also prints the audit of a bf16 engine against the fp32 learner.

    python bench/old_logprobs.py [--repeats 5] [--size small|tiny]

The last line is `ratio=<rollout / recompute>` (target <= 0.80; 0.75 is the limit for
fwd:bwd = 1:2 with one old-policy forward).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096),
}


def random_qwen3(size: str) -> str:
    """A folder with a seeded random Qwen3 model of `SIZES[size]` (same weights on every call)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hc = Qwen3Config(max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=2,
                     pad_token_id=3, **SIZES[size])
    d = tempfile.mkdtemp()
    Qwen3ForCausalLM(hc).save_pretrained(d)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()

    from megatron_gspo.data.batch import pad_rows
    from megatron_gspo.loop import build, phases
    from megatron_gspo.loop import weight_sync_phase as sync_phase
    from megatron_gspo.algo.precision import ToleranceController, audit_sums, finalize_audit
    from megatron_gspo.config import load_config
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    d = random_qwen3(args.size)
    n_seq = args.prompts * args.group
    common = [f"model.path={d}", "model.dtype=float32", "optimizer.lr=1e-6",
              f"rollout.group_size={args.group}", f"train.prompts_per_step={args.prompts}",
              "algorithm.mini_batches=4", f"rollout.max_new_tokens={args.new_tokens}",
              "algorithm.micro_batch_tokens=4096"]
    cfg = load_config(None, common)
    hf = build.read_hf_config(d)
    learner = build.learner(cfg, hf)
    build.load_initial_weights(cfg, learner, hf)
    engine = EmbeddedEngine(dict(hf), dtype="bfloat16", seed=0)
    cfg.rollout.dtype = "bfloat16"
    sync_phase.sync_weights(learner, engine, hf, cfg, version=0)
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, n=args.group,
                        ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    reqs = [GenerateRequest(prompt_ids=torch.randint(10, SIZES[args.size]["vocab_size"], (32,),
                                                     generator=g).tolist(), sampling=sp)
            for _ in range(args.prompts)]
    samples = engine.generate(reqs)
    for i, s in enumerate(samples):
        s.reward = float(i % 3)
    phases.fill_advantages(cfg, samples)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)

    lps = learner.forward_logprobs(samples)
    pad = pad_rows
    audit = finalize_audit(audit_sums(pad(lps), pad([s.rollout_logprobs for s in samples]),
                                      pad([list(map(float, s.loss_mask)) for s in samples]),
                                      eps_low=3e-4, eps_high=4e-4))

    def train_phase(mode: str) -> float:
        cfg.precision.old_logprobs = mode
        ctl = ToleranceController(mode, audit_fraction=0.0)
        t0 = time.perf_counter()
        old, _, _ = phases.old_logprobs(cfg, learner, ctl, samples, step=1)
        phases.train_on_batch(cfg, learner, samples, old, step=1)
        return time.perf_counter() - t0

    train_phase("rollout")  # warm-up
    times = {"recompute": [], "rollout": []}
    for _ in range(args.repeats):
        for mode in ("recompute", "rollout"):
            times[mode].append(train_phase(mode))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model={args.size} sequences={n_seq} tokens/step={tokens} mini_batches=4 "
          f"repeats={args.repeats}")
    print(f"{'pi_old source':>14} | {'median s':>9} | {'min s':>7} | {'max s':>7}")
    for k in ("recompute", "rollout"):
        print(f"{k:>14} | {med[k]:>9.3f} | {min(times[k]):>7.3f} | {max(times[k]):>7.3f}")
    print("audit (bf16 engine vs fp32 learner): " + ", ".join(
        f"{k}={v:.3g}" for k, v in audit.items()))
    learner.shutdown()
    print(f"ratio={med['rollout'] / med['recompute']:.3f}")


if __name__ == "__main__":
    main()
