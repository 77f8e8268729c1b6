"""Parameter names of the Transformer Engine layer spec <-> the local spec's (canonical) names.

The TE spec fuses the pre-attention / pre-MLP norms into the following linear layer (not in MoE
layers, whose pre-MLP norm stays a module), multi-latent attention's q / kv latent norms into
the up projections, and stores grouped experts as ``experts.linear_fc1.weight{e}``.
"""

from __future__ import annotations

import re

_TE_RULES = [
    (r"\.input_layernorm\.(weight|bias)$", r".self_attention.linear_qkv.layer_norm_\1"),
    (r"(layers\.\d+)\.pre_mlp_layernorm\.(weight|bias)$", r"\1.mlp.linear_fc1.layer_norm_\2"),
    (r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$", r".experts.\2.\3\1"),
]
_TE_BACK = [  # (+ multi-latent attention's q / kv latent norms, fused into the up projections)
    (r"\.self_attention\.linear_(q|kv)_up_proj\.layer_norm_weight$",
     r".self_attention.\1_layernorm.weight"),
    (r"\.self_attention\.linear_qkv\.layer_norm_(weight|bias)$", r".input_layernorm.\1"),
    (r"\.mlp\.linear_fc1\.layer_norm_(weight|bias)$", r".pre_mlp_layernorm.\1"),
    (r"\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$", r".experts.local_experts.\3.\1.\2"),
]


def to_te_name(name: str, moe: bool) -> str:
    """Canonical (local spec) name -> Transformer Engine spec name.

    Args:
        name: canonical name.
        moe: True when the layer is an MoE layer (its pre-MLP norm stays a separate module).
    """
    for pat, rep in _TE_RULES:
        if moe and "pre_mlp_layernorm" in pat:
            continue
        name = re.sub(pat, rep, name)
    return name


def from_te_name(name: str) -> str:
    """Transformer Engine spec name -> canonical (local spec) name."""
    for pat, rep in _TE_BACK:
        name = re.sub(pat, rep, name)
    return name


