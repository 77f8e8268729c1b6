"""Tiny random Qwen3-Next (Qwen3NextForCausalLM) shaped like Qwen3-Next-80B-A3B's config.json
(the real value of each field in its comment), for the parity and conversion tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

ARCH = "Qwen3NextForCausalLM"
QWEN3_NEXT = {
    "vocab_size": 160,  # 151936
    "hidden_size": 64,  # 2048
    "intermediate_size": 96,  # 5120 (dense layers: mlp_only_layers, none in the release)
    "num_hidden_layers": 4,  # 48
    "full_attention_interval": 4,  # 4 (layer_types: 3 linear, then 1 full)
    "num_attention_heads": 4,  # 16
    "num_key_value_heads": 2,  # 2
    "head_dim": 16,  # 256
    "partial_rotary_factor": 0.25,  # 0.25
    "rope_theta": 10000.0,  # 10000000
    "linear_conv_kernel_dim": 4,  # 4
    "linear_key_head_dim": 8,  # 128
    "linear_value_head_dim": 8,  # 128
    "linear_num_key_heads": 2,  # 16
    "linear_num_value_heads": 4,  # 32
    "num_experts": 8,  # 512
    "num_experts_per_tok": 2,  # 10
    "moe_intermediate_size": 16,  # 512
    "shared_expert_intermediate_size": 24,  # 512
    "norm_topk_prob": True,  # true
    "decoder_sparse_step": 1,  # 1
    "mlp_only_layers": [],  # []
    "rms_norm_eps": 1e-6,  # 1e-6
    "max_position_embeddings": 4096,  # 262144
    "hidden_act": "silu",
    "tie_word_embeddings": False,  # false
}


def make_qwen3_next(out_dir: Path, seed: int = 0, **changes) -> torch.nn.Module:
    """Build, perturb and save a tiny random Qwen3-Next; returns it (fp32, eval mode)."""
    from tests.convert.tiny_families import _perturb

    fields = {**QWEN3_NEXT, **changes}
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta"),
            "partial_rotary_factor": fields.pop("partial_rotary_factor")}
    every = fields.pop("full_attention_interval")
    fields["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                             for i in range(fields["num_hidden_layers"])]
    cfg = transformers.Qwen3NextConfig(**fields, rope_parameters=rope)
    cfg.architectures = [ARCH]
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    _perturb(model)
    with torch.no_grad():  # gates and decays away from their init, so each one matters
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "shared_expert_gate.weight", "conv1d.weight")):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    (Path(out_dir) / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return model
