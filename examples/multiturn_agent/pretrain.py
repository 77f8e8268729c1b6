"""Deterministic pre-training of the multi-turn demo model (a tiny Qwen3-architecture LM).

Supervised training of a small Qwen3ForCausalLM (0.9M parameters) on reference episodes of
`task.py` (loss on the model's turns only: the tool call and the final answer) with label
smoothing 0.02: every token keeps ~2% of its probability spread over the vocabulary, so over the
~65 tokens of an episode's turns a sample at temperature 1 solves the problem end to end only
~30% of the time. RL starts from a model that sometimes succeeds and has a clear signal to
raise. Evaluates with the real episode runner and embedded engine (sampling at temperature 1),
and writes the demo's prompt files.

Usage: python examples/multiturn_agent/pretrain.py [--out examples/multiturn_agent/base]
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
import task  # noqa: E402
from demo_pretrain import save_demo_model, sft  # noqa: E402
from env import ArithmeticAgentEnv  # noqa: E402

MODEL = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=320,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def encode_episode(tok, row: dict) -> tuple[list[int], list[int]]:
    """Token ids of a reference episode and its loss mask (1 on the model's turns)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, is_model in task.reference_episode(row):
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [int(is_model)] * len(piece)
    return ids, mask


def make_batch(tok, rng: random.Random, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch and labels (-100 outside the model's turns)."""
    seqs = [encode_episode(tok, task.make_problem(rng)) for _ in range(batch_size)]
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((batch_size, width), tok.pad_token_id, dtype=torch.long)  # [B, T]
    labels = torch.full((batch_size, width), -100, dtype=torch.long)  # [B, T]
    for i, (s, m) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        lab = torch.tensor(s)
        lab[torch.tensor(m) == 0] = -100
        labels[i, : len(s)] = lab
    return ids, labels


def evaluate_episodes(model, tok, rows: list[dict], seed: int = 0) -> dict:
    """Run real episodes (embedded engine, temperature 1) and report success statistics."""
    from megatron_gspo.agent.runner import EpisodeLimits, EpisodeRunner, episode_metrics
    from megatron_gspo.rollout.engine import SamplingParams
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    model.eval()
    engine = EmbeddedEngine(model, dtype="float32", seed=seed,
                            eos_token_ids=[tok.eos_token_id], max_model_len=320)
    runner = EpisodeRunner(
        engine, tok, ArithmeticAgentEnv,
        sampling=SamplingParams(max_new_tokens=96, temperature=1.0),
        limits=EpisodeLimits(max_turns=3, max_total_tokens=320, max_new_tokens_per_turn=96),
    )
    samples = runner.run_batch_sync(rows)
    engine.shutdown()
    model.train()
    m = episode_metrics(samples)
    return {"reward": round(m["agent/reward"], 3), "correct": round(m.get("agent/correct", 0), 3),
            "tool_calls": round(m.get("agent/tool_calls", 0), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "base"))
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--label-smoothing", type=float, default=0.02,
                    help="share of each target's probability spread over the vocabulary")
    ap.add_argument("--eval-every", type=int, default=0, help="0: evaluate only at the end")
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    tok = task.build_tokenizer()

    data = Path(args.data)
    train_rows = [task.make_problem(random.Random(f"train-{i}")) for i in range(2000)]
    eval_rows = [task.make_problem(random.Random(f"eval-{i}")) for i in range(256)]
    task.write_jsonl(data / "train.jsonl", train_rows)
    task.write_jsonl(data / "eval.jsonl", eval_rows)

    config = Qwen3Config(vocab_size=task.VOCAB_SIZE, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **MODEL)
    model = Qwen3ForCausalLM(config)
    rng = random.Random(args.seed)
    t0 = time.time()

    def report(step: int, loss: float) -> None:
        if args.eval_every and step % args.eval_every == 0:
            ev = evaluate_episodes(model, tok, eval_rows[: args.eval_rows])
            print(f"step {step:5d} loss {loss:.4f} {ev} ({time.time() - t0:.0f}s)", flush=True)

    loss = sft(model, lambda: make_batch(tok, rng, args.batch_size), steps=args.steps,
               lr=args.lr, label_smoothing=args.label_smoothing, on_step=report)
    ev = evaluate_episodes(model, tok, eval_rows[: args.eval_rows])
    print(json.dumps({"steps": args.steps, "loss": round(loss, 4), **ev,
                      "seconds": round(time.time() - t0, 1)}))
    save_demo_model(model, tok, Path(args.out), eos_token_ids=[tok.eos_token_id],
                    chat_template=task.CHAT_TEMPLATE)

if __name__ == "__main__":
    main()
