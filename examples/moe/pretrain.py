"""Deterministic pre-training of the MoE demo model (a Qwen3-MoE causal LM).

Same task, tokenizer, chat template and recipe as the tiny demo (examples/tiny: 2-digit addition,
loss on the answer tokens only, label smoothing), with a small Qwen3MoeForCausalLM: 2 decoder
layers, each a sparse MoE block of 8 experts with top-2 softmax routing (no renormalisation of the
top-2 probabilities, as in Qwen3-MoE). The result knows most answers greedily but samples at
temperature 1 are right only part of the time, so RL has something to learn; its routers are
trained (not random), so routing replay and routing metrics act on a meaningful router.
Everything is seeded: re-running reproduces examples/moe/base on the same torch build.
The demo reuses the tiny demo's prompt files (examples/tiny/data).

Usage: python examples/moe/pretrain.py [--out examples/moe/base]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TINY = HERE.parent / "tiny"
sys.path.insert(0, str(TINY))
sys.path.insert(0, str(HERE.parent))
import task  # noqa: E402  (examples/tiny/task.py)
from demo_pretrain import save_demo_model, sft  # noqa: E402

MODEL = dict(
    hidden_size=64,
    intermediate_size=128,  # unused by Qwen3-MoE when every layer is sparse
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    decoder_sparse_step=1,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.0,
)


def _tiny_pretrain():
    """examples/tiny/pretrain.py as a module (batching and accuracy helpers)."""
    spec = importlib.util.spec_from_file_location("tiny_pretrain", TINY / "pretrain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "base"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--label-smoothing", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tiny = _tiny_pretrain()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    tok = task.build_tokenizer()
    eval_rows = task.demo_rows("eval", 256)
    config = Qwen3MoeConfig(vocab_size=task.VOCAB_SIZE, bos_token_id=None,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **MODEL)
    model = Qwen3MoeForCausalLM(config)
    rng = random.Random(args.seed)
    t0 = time.time()
    loss = sft(model, lambda: tiny.make_batch(tok, rng, args.batch_size), steps=args.steps,
               lr=args.lr, label_smoothing=args.label_smoothing)
    greedy = tiny.accuracy(model, tok, eval_rows, do_sample=False)
    sampled = tiny.accuracy(model, tok, eval_rows * 2, do_sample=True)
    print(json.dumps({"steps": args.steps, "loss": round(loss, 4), "greedy_acc": greedy,
                      "sampled_acc_t1": sampled, "seconds": round(time.time() - t0, 1)}))
    out = Path(args.out)
    save_demo_model(model, tok, out, chat_template=task.CHAT_TEMPLATE,
                    eos_token_ids=[tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")])
    # readers built on transformers 4.x (and inference servers) look for `num_experts`
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
