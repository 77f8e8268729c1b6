"""Tiny random Hugging Face models (transformers' own classes) saved as safetensors for tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}

ARCHS = {
    "LlamaForCausalLM": (transformers.LlamaConfig, {"head_dim": 8}),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "Qwen3ForCausalLM": (transformers.Qwen3Config, {"head_dim": 16}),
    "Qwen3MoeForCausalLM": (
        transformers.Qwen3MoeConfig,
        {
            "head_dim": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "norm_topk_prob": True,
        },
    ),
}


def make_tiny_model(arch: str, out_dir: Path, seed: int = 0, **config_overrides):
    """Build a random tiny `arch` model, give norms/biases non-trivial values, save it.

    Args:
        config_overrides: config fields on top of the tiny shape (e.g. pad_token_id).
    Returns:
        the transformers model (fp32, eval mode).
    """
    cfg_cls, extra = ARCHS[arch]
    cfg = cfg_cls(**{**COMMON, **extra, **config_overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    (Path(out_dir) / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return model
