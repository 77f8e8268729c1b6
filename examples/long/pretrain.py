"""Deterministic pre-training of the long-response example's models (dense Qwen3 and Qwen3-MoE).

Supervised training on the labelled-sum task of `task.py` (loss on the response tokens only:
the shown work, the "Answer:" line and <|im_end|>), with the shared seeded loop of
examples/demo_pretrain.py. Every batch holds problems of one size n (drawn per batch), so
its rows differ in length only by the digits of their running sums (little padding). The
models are small enough for RL on CPU; the aim is samples at temperature 1 that are right a fair
share of the time (one wrong line misses the total), so that RL has a signal. The script prints
the accuracy it reached; check it before training on the result. Measured (seeded defaults, one
thread, on a shared 2-core machine):
- dense (0.42M parameters, 1500 steps of 16 problems): 851 s wall, final loss below 1e-4; on
  the first 32 eval prompts greedy 31/32 and temperature-1 30/32 right (mean 177 response
  tokens); at step 1000 of the same run 20/32 at temperature 1.
- MoE (0.66M parameters, 4 layers of 16 experts, top-4; 800 steps): 252 s wall, final loss
  0.003; on the first 64 eval prompts greedy 47/64 and temperature-1 32/64 right (mean 160
  response tokens). 800 steps on purpose: at 1200 steps it is right 29/32 at temperature 1,
  and a study on it has little left to learn (sampled reward 0.92-1.0 from the first step).

    python examples/long/pretrain.py --arch dense    # -> examples/long/base
    python examples/long/pretrain.py --arch moe      # -> examples/long/base_moe

Also writes the prompt files (examples/long/data). Everything is seeded: re-running reproduces
the models on the same torch build. Prints the greedy and sampled (temperature 1) accuracy on
the first eval prompts, and the mean response length, as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))
import task  # noqa: E402  (examples/long/task.py)
from demo_pretrain import save_demo_model, sft  # noqa: E402

COMMON = dict(max_position_embeddings=task.MAX_LENGTH, rope_theta=10000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=False)
ARCHS = {
    # dense Qwen3: 4 layers, hidden 96
    "dense": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=16, **COMMON),
    # Qwen3-MoE: 4 layers, each a sparse block of 16 experts, top-4 (no renormalisation)
    "moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                decoder_sparse_step=1, router_aux_loss_coef=0.0, **COMMON),
}
OUT = {"dense": HERE / "base", "moe": HERE / "base_moe"}
DEFAULT_STEPS = {"dense": 1500, "moe": 800}


def encode(tok, row: dict) -> tuple[list[int], int]:
    """Token ids of chat prompt + solution + <|im_end|>, and the prompt length."""
    prompt = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                     add_generation_prompt=True, tokenize=False)
    p_ids = tok.encode(prompt, add_special_tokens=False)
    a_ids = tok.encode(task.solution(row["numbers"]) + "<|im_end|>", add_special_tokens=False)
    return p_ids + a_ids, len(p_ids)


def make_batch(tok, rng: random.Random, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` problems of one drawn size n: ids [B, T], labels [B, T] (prompt: -100)."""
    n = rng.randint(task.N_MIN, task.N_MAX)
    seqs = [encode(tok, task.make_problem(rng, n)) for _ in range(batch_size)]
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((batch_size, width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    for i, (s, n_prompt) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, n_prompt: len(s)] = torch.tensor(s[n_prompt:])
    return ids, labels


@torch.no_grad()
def accuracy(model, tok, rows: list[dict], temperature: float, seed: int = 0) -> dict:
    """Mean `task.reward` and response length of samples from the embedded rollout engine."""
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    model.eval()
    engine = EmbeddedEngine(model, dtype="float32", seed=seed)
    sp = SamplingParams(max_new_tokens=task.MAX_LENGTH // 2, temperature=temperature)
    reqs = [GenerateRequest(prompt_ids=encode(tok, r)[0][: encode(tok, r)[1]], sampling=sp)
            for r in rows]
    samples = engine.generate(reqs)
    engine.shutdown()
    model.train()
    texts = [tok.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    rewards = [task.reward(t, r["answer"], {}) for t, r in zip(texts, rows, strict=True)]
    return {"acc": sum(rewards) / len(rows),
            "length": sum(len(s.response_ids) for s in samples) / len(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="dense")
    ap.add_argument("--out", default=None, help="default: examples/long/base[_moe]")
    ap.add_argument("--steps", type=int, default=None, help="default: dense 1500, moe 800")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    ap.add_argument("--eval-rows", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=0, help="0: evaluate only at the end")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.steps is None:
        args.steps = DEFAULT_STEPS[args.arch]

    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    tok = task.build_tokenizer()
    _, eval_rows = task.write_data(HERE / "data")
    eval_rows = eval_rows[: args.eval_rows]
    cfg_cls, model_cls = ((Qwen3MoeConfig, Qwen3MoeForCausalLM) if args.arch == "moe"
                          else (Qwen3Config, Qwen3ForCausalLM))
    config = cfg_cls(vocab_size=task.VOCAB_SIZE, bos_token_id=None, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, **ARCHS[args.arch])
    model = model_cls(config)
    rng = random.Random(args.seed)
    t0 = time.time()

    def report(step: int, loss: float) -> None:
        if step % 25 == 0:
            print(f"step {step:5d} loss {loss:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if args.eval_every and step % args.eval_every == 0:
            print(f"step {step:5d} sampled {accuracy(model, tok, eval_rows, 1.0)}", flush=True)

    loss = sft(model, lambda: make_batch(tok, rng, args.batch_size), steps=args.steps,
               lr=args.lr, label_smoothing=args.label_smoothing, on_step=report)
    greedy = accuracy(model, tok, eval_rows, 0.0)
    sampled = accuracy(model, tok, eval_rows, 1.0)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"arch": args.arch, "params": params, "steps": args.steps,
                      "loss": round(loss, 4), "greedy_acc": greedy["acc"],
                      "sampled_acc_t1": sampled["acc"], "sampled_length": sampled["length"],
                      "seconds": round(time.time() - t0, 1)}))
    out = Path(args.out) if args.out else OUT[args.arch]
    save_demo_model(model, tok, out, chat_template=task.CHAT_TEMPLATE,
                    eos_token_ids=[tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")])
    if args.arch == "moe":  # readers built on transformers 4.x look for `num_experts`
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.setdefault("num_experts", cfg.get("num_local_experts"))
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
