"""The long-response example's task: labelled multi-number sums with every step shown.

Prompt: "Add a3 b7 c1 ... (n numbers)", n in [N_MIN, N_MAX], each number one digit 1-9,
labelled a-z then A-Z (the label right before its digit). Answer: one line per number with its
label and digit, the running sum so far, the addition and its result, then the total:

    a3: 0+3=3
    b7: 3+7=10
    c1: 10+1=11
    ...
    Answer: 11<|im_end|>

Each line needs a lookup (the digit right after the line's label in the prompt, the next label
in the fixed order), a copy of the previous line's result and a one-digit addition whose
operands stand on the line itself, so every step is local and the response is a chain of
thought whose length grows with n: about 11 n + 10 tokens, 76-254 tokens (mean 166) on the
256 eval prompts for n = 6-20 with the character-level tokenizer of the tiny example
(examples/tiny/task.py; one token per character). n stops at 20 so that a 4-layer model
pre-trained in minutes on CPU gets a fair share of its samples right;
`make_problem(rng, n)` takes n up to 52.

Reward (`reward`): 1.0 when the response's line "Answer: <int>" holds the right total, else 0;
`reward_with_work` also asks that every shown line be right. `python examples/long/task.py`
rewrites the prompt files in examples/long/data.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load_tiny_task():
    """examples/tiny/task.py (tokenizer, chat template) under its own module name."""
    spec = importlib.util.spec_from_file_location("tiny_task", HERE.parent / "tiny" / "task.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_tiny = _load_tiny_task()

LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
N_MIN, N_MAX = 6, 20
CHAT_TEMPLATE = _tiny.CHAT_TEMPLATE
VOCAB_SIZE = _tiny.VOCAB_SIZE
MAX_LENGTH = 1024  # prompt + response tokens the models are built for
_ANSWER = re.compile(r"Answer:\s*(-?\d+)\s*$")
_LINE = re.compile(r"^([A-Za-z])(\d): (\d+)\+(\d)=(\d+)$")


def make_problem(rng: random.Random, n: int | None = None) -> dict:
    """One problem as a dataset row: {"prompt", "answer", "numbers"} (n drawn when None)."""
    n = rng.randint(N_MIN, N_MAX) if n is None else n
    if not 1 <= n <= len(LABELS):
        raise ValueError(f"n: expected 1..{len(LABELS)} numbers, got {n}")
    nums = [rng.randint(1, 9) for _ in range(n)]
    prompt = "Add " + " ".join(f"{LABELS[i]}{x}" for i, x in enumerate(nums))
    return {"prompt": prompt, "answer": str(sum(nums)), "numbers": nums}


def solution(numbers: list[int]) -> str:
    """The shown work and final line for `numbers` (the text a perfect model writes)."""
    lines, total = [], 0
    for label, x in zip(LABELS, numbers, strict=False):
        lines.append(f"{label}{x}: {total}+{x}={total + x}")
        total += x
    return "\n".join(lines) + f"\nAnswer: {total}"


def parse_prompt(prompt: str) -> list[int]:
    """The numbers of a prompt written by `make_problem`, in label order."""
    body = prompt.strip()
    if not body.startswith("Add "):
        raise ValueError(f"not a prompt of this task: {prompt[:40]!r}")
    nums = []
    for i, item in enumerate(body[4:].split()):
        label, value = item[:1], item[1:]
        if label != LABELS[i] or len(value) != 1 or not value.isdigit():
            raise ValueError(f"prompt item {i} is {item!r}, expected {LABELS[i]}<digit>")
        nums.append(int(value))
    return nums


def final_answer(response: str) -> int | None:
    """The integer of the response's last line when it reads "Answer: <int>", else None."""
    m = _ANSWER.search(response.strip())
    return int(m.group(1)) if m else None


def reward(response: str, label, metadata) -> float:
    """1.0 when "Answer: <total>" ends the response with the right total, else 0.0."""
    got = final_answer(response)
    return float(got is not None and label is not None and str(got) == str(label).strip())


def work_errors(response: str, numbers: list[int]) -> int:
    """Lines of shown work that are missing or wrong (label, number or running sum)."""
    want = solution(numbers).split("\n")[:-1]
    got = [ln.strip() for ln in response.strip().split("\n")[:-1]]
    wrong = sum(1 for w, g in zip(want, got, strict=False) if w != g or not _LINE.match(g))
    return wrong + abs(len(want) - len(got))


def reward_with_work(response: str, label, metadata) -> float:
    """`reward`, and also every shown line right (needs metadata["numbers"] or the prompt)."""
    nums = (metadata or {}).get("numbers")
    if nums is None:
        return reward(response, label, metadata)
    return float(reward(response, label, metadata) == 1.0 and work_errors(response, nums) == 0)


def rows(split: str, n_rows: int) -> list[dict]:
    """Rows of a prompt file; row i is drawn from its own seed "long-<split>-<i>"."""
    return [make_problem(random.Random(f"long-{split}-{i}")) for i in range(n_rows)]


def write_jsonl(path: Path, items: list[dict]) -> None:
    """Write rows as one JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in items:
            f.write(json.dumps({"prompt": row["prompt"], "answer": row["answer"]}) + "\n")


def write_data(data_dir: Path) -> tuple[list[dict], list[dict]]:
    """Write train.jsonl (2000 prompts) and eval.jsonl (256 prompts); return both row lists."""
    train, evals = rows("train", 2000), rows("eval", 256)
    write_jsonl(Path(data_dir) / "train.jsonl", train)
    write_jsonl(Path(data_dir) / "eval.jsonl", evals)
    return train, evals


def build_tokenizer():
    """The tiny example's character-level tokenizer, allowed MAX_LENGTH tokens."""
    tok = _tiny.build_tokenizer()
    tok.model_max_length = MAX_LENGTH
    return tok


if __name__ == "__main__":
    write_data(HERE / "data")
