"""The tiny demo's synthetic task and tokenizer.

Task: two-operand addition of 2-digit numbers, asked as "What is 37+58?" and answered with
the bare number followed by <|im_end|>. The reward is the `math` reward (last number in the
response compared with the label).

Tokenizer: character-level (one token per printable ASCII character and newline) built with
the `tokenizers` library, plus Qwen-style special tokens and a Qwen-style chat template. The
vocabulary is padded with reserved special tokens to VOCAB_SIZE (a multiple of 128, so any
tensor-parallel size up to 128 divides it without padding).

`python examples/tiny/task.py` rewrites the prompt files in examples/tiny/data.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB_SIZE = 128
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|unk|>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
OPERAND_RANGE = (10, 99)


def make_problem(rng: random.Random) -> dict:
    """One addition problem as a dataset row: {"prompt": str, "answer": str}."""
    a = rng.randint(*OPERAND_RANGE)
    b = rng.randint(*OPERAND_RANGE)
    return {"prompt": f"What is {a}+{b}?", "answer": str(a + b)}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write rows as one JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def demo_rows(split: str, n: int) -> list[dict]:
    """Rows of a prompt file; row i is drawn from its own seed "<split>-<i>"."""
    return [make_problem(random.Random(f"{split}-{i}")) for i in range(n)]


def write_demo_data(data_dir: Path) -> tuple[list[dict], list[dict]]:
    """Write train.jsonl (2000 prompts) and eval.jsonl (256 prompts); return both row lists."""
    train, evals = demo_rows("train", 2000), demo_rows("eval", 256)
    write_jsonl(Path(data_dir) / "train.jsonl", train)
    write_jsonl(Path(data_dir) / "eval.jsonl", evals)
    return train, evals


def build_tokenizer():
    """Character-level fast tokenizer with Qwen-style specials and chat template.

    Returns:
        a transformers PreTrainedTokenizerFast with len(tokenizer) == VOCAB_SIZE.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(CHARS))]
    specials = SPECIAL_TOKENS + reserved
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + reserved)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    assert len(hf) == VOCAB_SIZE, len(hf)
    return hf


if __name__ == "__main__":
    write_demo_data(Path(__file__).resolve().parent / "data")
