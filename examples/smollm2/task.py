"""The SmolLM2 example's task: adding a 1-digit and a 2-digit number, answered in \\boxed{}.

    python examples/smollm2/task.py          # rewrites data/train.jsonl and data/eval.jsonl

Rows are {"prompt": "What is 7 + 38? Put the final answer in \\boxed{}.", "answer": "45"};
the prompt is rendered with the model's own chat template (`data.apply_chat_template`). Row i
of a split is drawn from its own seed "<split>-<i>", so both files are deterministic, and the
eval problems are checked to be disjoint from the train problems.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "What is {a} + {b}? Put the final answer in \\boxed{{}}."
A_RANGE = (1, 9)
B_RANGE = (10, 99)
N_TRAIN, N_EVAL = 2000, 128


def make_problem(rng: random.Random) -> dict:
    """One row: {"prompt": str, "answer": str}."""
    a, b = rng.randint(*A_RANGE), rng.randint(*B_RANGE)
    if rng.random() < 0.5:
        a, b = b, a
    return {"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b)}


def rows(split: str, n: int, exclude: set[str] = frozenset()) -> list[dict]:
    """n rows of a split; row i comes from seed "<split>-<i>" (redrawn while in `exclude`)."""
    out = []
    for i in range(n):
        rng = random.Random(f"{split}-{i}")
        row = make_problem(rng)
        while row["prompt"] in exclude:
            row = make_problem(rng)
        out.append(row)
    return out


def write_jsonl(path: Path, data: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in data:
            f.write(json.dumps(row) + "\n")


def write_data(data_dir: Path = HERE / "data") -> tuple[list[dict], list[dict]]:
    """Write train.jsonl and eval.jsonl (eval disjoint from train); return both."""
    train = rows("train", N_TRAIN)
    evals = rows("eval", N_EVAL, exclude={r["prompt"] for r in train})
    write_jsonl(Path(data_dir) / "train.jsonl", train)
    write_jsonl(Path(data_dir) / "eval.jsonl", evals)
    return train, evals


if __name__ == "__main__":
    write_data()
