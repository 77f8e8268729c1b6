"""Deterministic pre-training of the tiny demo model (a Qwen3-architecture causal LM).

Trains a small Qwen3ForCausalLM (0.9M parameters) on the addition task of `task.py` (loss on
the answer tokens only) with label smoothing 0.3. The result knows the answers (greedy accuracy
~1.0) but spreads ~30% of every token's probability over the whole vocabulary, so a sample at
temperature 1 is right only ~35% of the time: RL starts from a model that sometimes succeeds
and has a clear, learnable signal (concentrate the probability on the answers it ranks first).
Also writes the demo's prompt files. Everything is seeded, so re-running reproduces the shipped
files in examples/tiny/base and examples/tiny/data (on the same torch build).

Usage: python examples/tiny/pretrain.py [--out examples/tiny/base] [--data examples/tiny/data]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import task  # noqa: E402
from demo_pretrain import save_demo_model, sft  # noqa: E402

from megatron_gspo.rewards import get_reward_fn  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def encode_example(tok, row: dict) -> tuple[list[int], int]:
    """Token ids of prompt + answer + <|im_end|>, and the prompt length."""
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
    )
    p_ids = tok.encode(prompt, add_special_tokens=False)
    a_ids = tok.encode(row["answer"] + "<|im_end|>", add_special_tokens=False)
    return p_ids + a_ids, len(p_ids)


def make_batch(tok, rng: random.Random, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch and labels with the prompt and padding masked (-100)."""
    seqs = [encode_example(tok, task.make_problem(rng)) for _ in range(batch_size)]
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((batch_size, width), tok.pad_token_id, dtype=torch.long)  # [B, T]
    labels = torch.full((batch_size, width), -100, dtype=torch.long)  # [B, T]
    for i, (s, n_prompt) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, n_prompt : len(s)] = torch.tensor(s[n_prompt:])
    return ids, labels


@torch.no_grad()
def accuracy(model, tok, rows: list[dict], do_sample: bool, seed: int = 0) -> float:
    """Mean `math` reward of generated answers (transformers generate).

    Args:
        model: the causal LM.
        tok: its tokenizer.
        rows: dataset rows {"prompt", "answer"}; all prompts of this task have equal length.
        do_sample: sample at temperature 1.0 (no top-k/top-p) when True, greedy otherwise.
        seed: torch seed for sampling.
    Returns:
        accuracy in [0, 1].
    """
    model.eval()
    torch.manual_seed(seed)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    ids = torch.tensor([tok.encode(p, add_special_tokens=False) for p in prompts])  # [B, T]
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(
        do_sample=False)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tok.pad_token_id, **kwargs,
    )
    texts = tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    model.train()
    reward = get_reward_fn("math")  # the demo's RL reward
    return sum(reward(t, r["answer"], {}) for t, r in zip(texts, rows, strict=True)) / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "base"))
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--label-smoothing", type=float, default=0.3,
                    help="share of each target's probability spread over the vocabulary")
    ap.add_argument("--eval-every", type=int, default=0, help="0: evaluate only at the end")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--evaluate-only", action="store_true",
                    help="only measure the accuracy of the model in --out")
    args = ap.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM

    if args.evaluate_only:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.out)
        model = AutoModelForCausalLM.from_pretrained(args.out)
        rows = [json.loads(x) for x in open(Path(args.data) / "eval.jsonl")]
        print(json.dumps({"greedy_acc": accuracy(model, tok, rows, do_sample=False),
                          "sampled_acc_t1": accuracy(model, tok, rows * 2, do_sample=True)}))
        return

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    tok = task.build_tokenizer()

    # prompt files for RL (train) and evaluation, from their own seeds
    _, eval_rows = task.write_demo_data(Path(args.data))

    config = Qwen3Config(
        vocab_size=task.VOCAB_SIZE,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **MODEL,
    )
    model = Qwen3ForCausalLM(config)
    rng = random.Random(args.seed)
    t0 = time.time()

    def report(step: int, loss: float) -> None:
        if args.eval_every and step % args.eval_every == 0:
            acc = accuracy(model, tok, eval_rows, do_sample=True)
            print(f"step {step:5d} loss {loss:.4f} sampled-acc {acc:.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)

    loss = sft(model, lambda: make_batch(tok, rng, args.batch_size), steps=args.steps,
               lr=args.lr, label_smoothing=args.label_smoothing, on_step=report)
    greedy = accuracy(model, tok, eval_rows, do_sample=False)
    sampled = accuracy(model, tok, eval_rows * 2, do_sample=True)
    print(json.dumps({"steps": args.steps, "loss": round(loss, 4),
                      "greedy_acc": greedy, "sampled_acc_t1": sampled,
                      "seconds": round(time.time() - t0, 1)}))
    save_demo_model(model, tok, Path(args.out), chat_template=task.CHAT_TEMPLATE,
                    eos_token_ids=[tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")])

if __name__ == "__main__":
    main()
