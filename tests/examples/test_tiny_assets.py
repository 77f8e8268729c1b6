"""The tiny demo's shipped assets: tokenizer, chat template, base model and prompt files."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from megatron_gspo.data.datasets import PromptDataset
from megatron_gspo.rewards import get_reward_fn

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny"
BASE = TINY / "base"


def _task_module():
    spec = importlib.util.spec_from_file_location("tiny_task", TINY / "task.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BASE)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(BASE).eval()


def test_files_and_config():
    names = {p.name for p in BASE.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in BASE.iterdir()) < 5 * 2**20
    cfg = json.loads((BASE / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["vocab_size"] % 8 == 0  # TP 2/4/8 need no vocab padding
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0


def test_tokenizer_and_chat_template(tok):
    assert len(tok) == 128
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")}
    assert len(set(ids.values())) == 4
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 12+34?"}],
        add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 12+34?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    enc = tok.encode(text, add_special_tokens=False)
    assert enc[0] == ids["<|im_start|>"] and enc.count(ids["<|im_end|>"]) == 2
    assert tok.decode(enc) == text
    assert tok.decode(tok.encode("46", add_special_tokens=False) + [ids["<|im_end|>"]],
                      skip_special_tokens=True) == "46"
    # the shipped tokenizer is the one task.py builds
    built = _task_module().build_tokenizer()
    assert built.encode(text, add_special_tokens=False) == enc


def test_prompt_files_match_generator(tok):
    task = _task_module()
    for name, n in (("train", 2000), ("eval", 256)):
        rows = [json.loads(x) for x in (TINY / "data" / f"{name}.jsonl").read_text().splitlines()]
        assert rows == task.demo_rows(name, n)
        for r in rows[:50]:
            a, b = map(int, re.fullmatch(r"What is (\d+)\+(\d+)\?", r["prompt"]).groups())
            assert r["answer"] == str(a + b)
    ds = PromptDataset(TINY / "data" / "eval.jsonl", tok, max_prompt_length=64)
    assert len(ds) == 256 and ds.num_skipped == 0
    assert ds[0].prompt.endswith("<|im_start|>assistant\n")


def _accuracy(model, tok, rows, **generate_kwargs) -> tuple[float, float]:
    """(math reward mean, share of answers that end with <|im_end|>)."""
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                       add_generation_prompt=True, tokenize=False) for r in rows]
    ids = torch.tensor([tok.encode(p, add_special_tokens=False) for p in prompts])  # [B, T]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             pad_token_id=tok.pad_token_id, **generate_kwargs)
    new = out[:, ids.shape[1]:]
    texts = tok.batch_decode(new, skip_special_tokens=True)
    reward = get_reward_fn("math")
    acc = sum(reward(t, r["answer"], {}) for t, r in zip(texts, rows, strict=True)) / len(rows)
    return acc, (new == tok.eos_token_id).any(dim=1).float().mean().item()


def test_base_model_knows_answers_but_samples_are_noisy(model, tok):
    rows = _task_module().demo_rows("eval", 128)
    greedy, ends = _accuracy(model, tok, rows, do_sample=False)
    assert ends > 0.9 and greedy > 0.9, (greedy, ends)
    torch.manual_seed(0)
    sampled, _ = _accuracy(model, tok, rows, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    assert 0.15 <= sampled <= 0.6, sampled  # RL has something to learn, and a signal to learn from
