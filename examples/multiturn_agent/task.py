"""The multi-turn agent demo's task, tokenizer and reference trajectories.

Task: two-step arithmetic word problems ("Ann buys 37 bags of 8 apples and 15 more apples. How
many apples?"). A tiny model cannot multiply 37 by 8 in its head, but it can call the calculator
with the expression and copy the result into its answer, so tool use is what earns the reward.

Tokenizer: character-level (one token per printable ASCII character and newline) built with the
`tokenizers` library, plus the Qwen3 chat and tool-call special tokens, each a single token, so
the episode runner can stop a turn on `</tool_call>`. Padded with reserved tokens to VOCAB_SIZE.

Reference trajectories are rendered with the same chat functions the episode runner uses, so
pre-training and RL see the same token layout.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from megatron_gspo.agent.chat import (
    QWEN3_CHAT_TEMPLATE,
    render_messages,
    render_observation,
)
from megatron_gspo.agent.tools.calculator import evaluate, format_number

VOCAB_SIZE = 128
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
    "<|unk|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
SYSTEM_PROMPT = "Use the calculator, then give the number."
# The tokenizer's chat template: the built-in renderer's layout as Jinja (append-only), so the
# episode runner's template path (agent.chat_template: tokenizer) gives the same tokens.
CHAT_TEMPLATE = QWEN3_CHAT_TEMPLATE
TEMPLATES = [
    ("Ann buys {a} bags of {b} apples and {c} more apples. How many apples?", "{a}*{b}+{c}"),
    ("A box has {a} rows of {b} eggs. {c} eggs break. How many eggs are left?", "{a}*{b}-{c}"),
    ("Tom reads {a} pages a day for {b} days, then {c} more. How many pages?", "{a}*{b}+{c}"),
    ("{a} vans carry {b} kids each and {c} kids walk. How many kids?", "{a}*{b}+{c}"),
]


def make_problem(rng: random.Random) -> dict:
    """One word problem as a dataset row: {"prompt", "label", "expression"}."""
    text, expr = rng.choice(TEMPLATES)
    a, b, c = rng.randint(12, 49), rng.randint(3, 9), rng.randint(2, 30)
    expr = expr.format(a=a, b=b, c=c)
    return {
        "prompt": text.format(a=a, b=b, c=c),
        "label": format_number(evaluate(expr)),
        "expression": expr,
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write rows as one JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def first_messages(row: dict) -> list[dict]:
    """The chat that opens an episode."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": row["prompt"]},
    ]


def reference_episode(row: dict) -> list[tuple[str, bool]]:
    """A correct episode as (text, is_model_text) pieces in the runner's exact layout:
    prompt, tool call (the turn stops at </tool_call>), tool response, final answer."""
    call = {"name": "calculator", "arguments": {"expression": row["expression"]}}
    result = format_number(evaluate(row["expression"]))
    return [
        (render_messages(first_messages(row)), False),
        ("<tool_call>" + json.dumps(call, separators=(",", ":")) + "</tool_call>", True),
        (render_observation([{"role": "tool", "content": result}], model_closed_turn=False), False),
        (f"{result}<|im_end|>", True),
    ]


def build_tokenizer():
    """Character-level fast tokenizer with the chat and tool-call specials.

    Returns:
        a transformers PreTrainedTokenizerFast with len(tokenizer) == VOCAB_SIZE.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(CHARS))]
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS + reserved)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS + reserved)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        additional_special_tokens=[
            t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|pad|>", "<|unk|>")
        ],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    if len(hf) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(hf)} tokens, expected {VOCAB_SIZE}")
    return hf
