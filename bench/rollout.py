"""Embedded rollout engine throughput: generated tokens/s with the KV cache vs a naive loop that
re-runs the whole sequence every step (no cache), for a tiny and a small Qwen3-style model.

Usage: python bench/rollout.py [--models tiny,small] [--batch-sizes 1,4,16,64]
       [--new-tokens 32] [--prompt-len 16] [--device cpu] [--dtype float32] [--threads N]
Prints one table: throughput by wall-clock time and by this process's CPU time (the latter is
the meaningful one on a shared, loaded machine; run with --threads 1 for it).
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
from megatron_gspo.rollout.embedded import EmbeddedEngine

MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=8192),
}


def _config(name: str) -> dict:
    return dict(model_type="qwen3", max_position_embeddings=2048, eos_token_id=0,
                tie_word_embeddings=True, **MODELS[name])


@torch.no_grad()
def naive_generate(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int,
                   gen: torch.Generator) -> torch.Tensor:
    """Sampling without a KV cache: a full forward over the whole sequence per new token.

    Args:
        model: causal LM.
        prompts: [B, P] prompt ids (same length, no padding).
        new_tokens: tokens to generate.
        gen: sampling generator.
    Returns:
        [B, P + new_tokens] ids.
    """
    ids = prompts
    for _ in range(new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()  # [B, V]
        tok = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)  # [B, 1]
        ids = torch.cat([ids, tok], dim=-1)
    return ids


def bench(name: str, batch: int, args: argparse.Namespace) -> tuple[float, float, float, float]:
    torch.manual_seed(0)
    eng = EmbeddedEngine(_config(name), dtype=args.dtype, device=args.device, seed=0)
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    prompt = [int(t) for t in torch.randint(1, 200, (args.prompt_len,))]
    reqs = [GenerateRequest(prompt, sp) for _ in range(batch)]
    eng.generate(reqs[:1])  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    out = eng.generate(reqs)
    t_kv, c_kv = time.perf_counter() - t0, time.process_time() - c0
    ntok = sum(len(s.response_ids) for s in out)
    ids = torch.tensor([prompt] * batch, device=args.device)
    t0, c0 = time.perf_counter(), time.process_time()
    naive_generate(eng.model, ids, args.new_tokens, torch.Generator(args.device).manual_seed(0))
    t_naive, c_naive = time.perf_counter() - t0, time.process_time() - c0
    nn = batch * args.new_tokens
    return ntok / t_kv, nn / t_naive, ntok / c_kv, nn / c_naive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"prompt={args.prompt_len} new_tokens={args.new_tokens}")
    print(f"{'model':<6} {'params':>8} {'batch':>5} {'kv tok/s':>9} {'naive tok/s':>11} "
          f"{'kv tok/cpu-s':>12} {'naive tok/cpu-s':>15} {'speedup(cpu)':>12}")
    for name in args.models.split(","):
        n_params = sum(p.numel() for p in EmbeddedEngine(_config(name)).model.parameters())
        for b in (int(x) for x in args.batch_sizes.split(",")):
            kv, naive, kv_c, naive_c = bench(name, b, args)
            print(f"{name:<6} {n_params / 1e6:>7.2f}M {b:>5} {kv:>9.1f} {naive:>11.1f} "
                  f"{kv_c:>12.1f} {naive_c:>15.1f} {kv_c / naive_c:>11.2f}x", flush=True)


if __name__ == "__main__":
    main()
