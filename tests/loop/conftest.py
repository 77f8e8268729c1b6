"""A tiny random Qwen3 model directory with the demo's character tokenizer (no hub needed)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def random_tiny_model(tmp_path_factory) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(ROOT / "examples" / "tiny"))
    from task import VOCAB_SIZE, build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    hc = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
                     eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                     pad_token_id=tok.pad_token_id)
    d = tmp_path_factory.mktemp("rand_tiny")
    Qwen3ForCausalLM(hc).save_pretrained(d)
    tok.save_pretrained(d)
    return d
