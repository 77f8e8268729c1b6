"""Tiny random DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5), built from the released
config.json fields (real values in the comments; sizes shrunk, `index_topk` below the test's
sequence length so the indexer's choice shapes the logits), as transformers' own classes saved
to safetensors. The indexers have 16 heads: with 2, many keys score exactly 0 (every head's
relu(q.k) zero) and which of the tied keys top-k keeps depends on the batch's shape (padding,
packing), so the engine and the learner could keep different ones.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.convert.tiny_families import DEEPSEEK_V3, _perturb

# deepseek-ai/DeepSeek-V3.2(-Exp) config.json: DeepSeek-V3's fields plus the indexer
DEEPSEEK_V32 = {
    **DEEPSEEK_V3,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "num_hidden_layers": 2,  # 61
    "index_n_heads": 16,  # 64
    "index_head_dim": 8,  # 128 (rope on its first qk_rope_head_dim channels)
    "index_topk": 4,  # 2048
}

# zai-org/GLM-5 config.json (real values in the comments); the tiny model shares top-k
# across layers as GLM-5.1/5.2's index-share configs do (index_topk_freq 4, offset 3 there)
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 160,  # 154880
    "hidden_size": 64,  # 6144
    "intermediate_size": 96,  # 12288
    "moe_intermediate_size": 16,  # 2048
    "num_hidden_layers": 4,  # 78
    "first_k_dense_replace": 1,  # 3
    "num_attention_heads": 4,  # 64
    "num_key_value_heads": 4,  # 64
    "q_lora_rank": 24,  # 2048
    "kv_lora_rank": 16,  # 512
    "qk_nope_head_dim": 8,  # 192
    "qk_rope_head_dim": 4,  # 64
    "v_head_dim": 12,  # 256
    "n_routed_experts": 8,  # 256
    "n_shared_experts": 1,  # 1
    "num_experts_per_tok": 2,  # 8
    "n_group": 1,  # 1
    "topk_group": 1,  # 1
    "routed_scaling_factor": 2.5,  # 2.5
    "norm_topk_prob": True,  # true
    "index_n_heads": 16,  # 32
    "index_head_dim": 8,  # 128
    "index_topk": 4,  # 2048
    "index_topk_freq": 2,  # 1 (GLM-5), 4 (GLM-5.2)
    "index_skip_topk_offset": 1,  # transformers' default 2; 3 (GLM-5.2)
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},  # as released
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
}

DSA_FAMILIES = {
    "DeepseekV32ForCausalLM": (transformers.DeepseekV32Config, DEEPSEEK_V32),
    "GlmMoeDsaForCausalLM": (transformers.GlmMoeDsaConfig, GLM5),
}


def make_dsa_model(arch: str, out_dir: Path, seed: int = 0) -> torch.nn.Module:
    """Build, perturb and save a tiny random DSA `arch` model; returns it (fp32, eval mode)."""
    cfg_cls, fields = DSA_FAMILIES[arch]
    cfg = cfg_cls(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")})
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    _perturb(model)
    model.save_pretrained(out_dir)
    (Path(out_dir) / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return model


def dense_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The same model's logits with every indexer keeping all tokens (dense MLA): the control
    that shows the sparse selection is part of the logits compared."""
    saved = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "index_topk") and hasattr(mod, "wq_b"):
            saved[name] = mod.index_topk
            mod.index_topk = tokens.shape[1]
    try:
        with torch.no_grad():
            return model(tokens).logits
    finally:
        for name, mod in model.named_modules():
            if name in saved:
                mod.index_topk = saved[name]
