"""Tiny random models of the families beyond Llama / Qwen, built from the real models'
config.json (field names, layer pattern, head-dim ratios, rope and routing settings kept; sizes
shrunk), as transformers' own classes saved to safetensors.

Each entry: the real config's fields (as released) next to the shrunk values used here.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

# deepseek-ai/DeepSeek-V3 config.json (real values in the comments)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 160,  # 129280
    "hidden_size": 64,  # 7168
    "intermediate_size": 96,  # 18432 (dense layers)
    "moe_intermediate_size": 16,  # 2048
    "num_hidden_layers": 4,  # 61
    "first_k_dense_replace": 1,  # 3 (leading dense layers)
    "moe_layer_freq": 1,  # 1 (SGLang's DeepseekV2 model class reads it without a default)
    "num_attention_heads": 4,  # 128
    "num_key_value_heads": 4,  # 128
    "q_lora_rank": 24,  # 1536
    "kv_lora_rank": 16,  # 512
    "qk_nope_head_dim": 8,  # 128
    "qk_rope_head_dim": 4,  # 64
    "v_head_dim": 12,  # 128 (kept different from qk head dim 12 -> 8+4 to test the split)
    "n_routed_experts": 8,  # 256
    "n_shared_experts": 1,  # 1
    "num_experts_per_tok": 4,  # 8
    "n_group": 4,  # 8
    "topk_group": 2,  # 4 (num_experts_per_tok / topk_group = 2, as in the real model)
    "routed_scaling_factor": 2.5,  # 2.5
    "norm_topk_prob": True,  # true
    "scoring_func": "sigmoid",  # sigmoid
    "topk_method": "noaux_tc",  # noaux_tc
    "rope_scaling": {  # as released
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 10000,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
}

# google/gemma-3-1b-it config.json (real values in the comments; the linear scaling of the
# global layers' rope is the one the 4B / 12B / 27B text configs carry)
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 160,  # 262144
    "hidden_size": 64,  # 1152
    "intermediate_size": 96,  # 6912
    "num_hidden_layers": 6,  # 26
    "num_attention_heads": 4,  # 4
    "num_key_value_heads": 2,  # 1 (2 here so that TP2 splits the KV heads)
    "head_dim": 16,  # 256
    "query_pre_attn_scalar": 24,  # 256 (= head_dim in 1B/4B; 27B uses 168 != head_dim)
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 5,  # 512 (shorter than the test sequences, so the window matters)
    "sliding_window_pattern": 6,  # 6: five sliding layers, then one global
    "rope_theta": 1000000.0,  # 1e6 (global layers)
    "rope_local_base_freq": 10000.0,  # 1e4 (sliding layers)
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},  # null in 1B, this in 4B+
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,
}

# zai-org/GLM-4.5 config.json (real values in the comments)
GLM4_MOE = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 160,  # 151552
    "hidden_size": 64,  # 5120
    "intermediate_size": 96,  # 12288 (dense layers)
    "moe_intermediate_size": 16,  # 1536
    "num_hidden_layers": 4,  # 92
    "first_k_dense_replace": 1,  # 3
    "num_attention_heads": 4,  # 96
    "num_key_value_heads": 2,  # 8
    "head_dim": 16,  # 128
    "partial_rotary_factor": 0.5,  # 0.5
    "attention_bias": True,  # true (q/k/v; o_proj has none)
    "use_qk_norm": True,  # true (false in GLM-4.5-Air)
    "n_routed_experts": 8,  # 160
    "n_shared_experts": 1,  # 1
    "num_experts_per_tok": 4,  # 8
    "n_group": 1,  # 1
    "topk_group": 1,  # 1
    "routed_scaling_factor": 2.5,  # 2.5
    "norm_topk_prob": True,  # true
    "rope_theta": 1000000.0,  # 1e6
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}

# openai/gpt-oss-20b config.json (real values in the comments), bf16-dequantized layout
GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 160,  # 201088
    "hidden_size": 64,  # 2880
    "intermediate_size": 16,  # 2880 (per expert)
    "num_hidden_layers": 4,  # 24
    "num_attention_heads": 4,  # 64
    "num_key_value_heads": 2,  # 8
    "head_dim": 16,  # 64
    "num_local_experts": 8,  # 32
    "num_experts_per_tok": 2,  # 4
    "sliding_window": 5,  # 128
    "layer_types": ["sliding_attention", "full_attention"] * 2,  # alternating, as released
    "rope_theta": 150000.0,  # 150000
    "rope_scaling": {  # as released
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False,
    },
    "max_position_embeddings": 131072,
    "swiglu_limit": 0.1,  # 7.0 (small here so that the clamp acts on tiny activations)
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

FAMILIES = {
    "DeepseekV3ForCausalLM": (transformers.DeepseekV3Config, DEEPSEEK_V3),
    "Gemma3ForCausalLM": (transformers.Gemma3TextConfig, GEMMA3),
    "Glm4MoeForCausalLM": (transformers.Glm4MoeConfig, GLM4_MOE),
    "GptOssForCausalLM": (transformers.GptOssConfig, GPT_OSS),
}


def fast_first(arch: str):
    """pytest parameter for `arch`: DeepSeek-V3 (MLA + MoE, the most pieces) in the default
    tier, the other families in the slow tier (each takes 10-40 s on 2 busy cores)."""
    import pytest

    return arch if arch == "DeepseekV3ForCausalLM" else pytest.param(arch, marks=pytest.mark.slow)


def _perturb(model: torch.nn.Module) -> None:
    """Norm weights and biases away from their init, routers sharp enough that routing matters
    (group choice, expert bias), expert biases spread so they change some choices."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)


def make_family_model(arch: str, out_dir: Path, seed: int = 0) -> torch.nn.Module:
    """Build, perturb and save a tiny random `arch` model; returns it (fp32, eval mode)."""
    cfg_cls, fields = FAMILIES[arch]
    cfg = cfg_cls(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")})
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    _perturb(model)
    model.save_pretrained(out_dir)
    (Path(out_dir) / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return model
