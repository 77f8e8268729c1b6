"""Gemma 3 (Gemma3ForCausalLM, text) in Megatron-Core 0.16.1: HF config -> TransformerConfig
fields and the local layer spec.

What maps onto what (transformers' `modeling_gemma3.py` vs Megatron-Core):
- `layer_types` (sliding / full, 5:1 in the released models) -> `window_size=(W-1, 0)` with
  `window_attn_skip_freq` as a per-layer 0/1 list (token i sees j when i - j < sliding_window);
- two rotary bases: global layers use GPTModel's table (`full_attention.rope_theta`, linear
  scaling -> `seq_len_interpolation_factor`), sliding layers their own
  (`sliding_attention.rope_theta`), see `gemma_layers.DualRopeSelfAttention`;
- `query_pre_attn_scalar` -> `softmax_scale = query_pre_attn_scalar ** -0.5`;
- q/k norms, input / pre-feedforward / final norms: `gemma_layers.GemmaRMSNorm` (1 + weight);
  `post_attention_layernorm` / `post_feedforward_layernorm` (sandwich norms):
  `gemma_layers.PostNormRowParallelLinear` as `linear_proj` / `linear_fc2`;
- GeGLU with tanh-approximated GELU (`gelu_pytorch_tanh`); embeddings scaled by
  sqrt(hidden_size) (`gemma_layers.scale_embeddings`); tied output layer.

Refused (one-line errors):
- the Transformer Engine spec: Megatron-Core 0.16.1's TransformerLayer has no post-attention /
  post-MLP norm and TE's fused norm+linear modules have no (1 + weight) post norm to hold
  them; Gemma 3 builds the local spec (on GPU too);
- `attn_logit_softcapping` / `final_logit_softcapping` (neither DotProductAttention nor
  GPTModel's output layer soft-caps), `use_bidirectional_attention=true`, rope types other than
  default / linear, `hidden_activation` other than gelu_pytorch_tanh.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_gspo.megatron.compat import submodules
from megatron_gspo.megatron.models.gemma_layers import (
    DualRopeSelfAttention,
    GemmaRMSNorm,
    PostNormRowParallelLinear,
    scale_embeddings,
)

ARCHITECTURE = "Gemma3ForCausalLM"
LOCAL_ONLY = "Gemma 3's sandwich norms (post-attention / post-MLP) have no Transformer Engine " \
             "module in Megatron-Core 0.16.1; it uses the local spec"


class GemmaConfigError(ValueError):
    """A Gemma 3 config field this build of Megatron-Core cannot express."""


@dataclass
class Gemma3TransformerConfig(TransformerConfig):
    """TransformerConfig plus the rotary base of the sliding-window layers."""

    local_rotary_base: float = 10000.0


CONFIG_CLASS = Gemma3TransformerConfig


def rope_settings(cfg: dict) -> tuple[float, float | None, float]:
    """(global rotary base, global linear scaling factor or None, sliding-layer rotary base)."""
    rp = cfg.get("rope_parameters") or {}
    full = dict(rp.get("full_attention") or {})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    local = dict(rp.get("sliding_attention") or {})
    for name, part in (("full_attention", full), ("sliding_attention", local)):
        kind = part.get("rope_type", part.get("type", "default"))
        if kind not in ("default", "linear") or (name == "sliding_attention" and kind != "default"):
            raise GemmaConfigError(f"config.json rope_parameters.{name}.rope_type={kind!r} is "
                                   "not supported (Gemma 3: default, or linear on full layers)")
    theta = float(full.get("rope_theta") or cfg.get("rope_theta") or 1e6)
    local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 1e4)
    kind = full.get("rope_type", full.get("type", "default"))
    factor = float(full["factor"]) if kind == "linear" else None
    return theta, factor, local_theta


def layer_types(cfg: dict) -> list[str]:
    """Per-layer "sliding_attention" / "full_attention" (from `layer_types`, or the older
    `sliding_window_pattern`: every N-th layer full)."""
    n = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
    else:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(n)]
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if len(types) != n or bad:
        raise GemmaConfigError(f"config.json layer_types: {len(types)} entries for {n} layers"
                               + (f", unknown {bad}" if bad else ""))
    return types


def config_fields(cfg: dict, use_te: bool) -> dict:
    """TransformerConfig fields of Gemma 3 on top of the dense defaults (one-line
    GemmaConfigError for what cannot be expressed)."""
    if use_te:
        raise GemmaConfigError(LOCAL_ONLY)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise GemmaConfigError(f"config.json {key}={cfg[key]} is not supported (Megatron-Core "
                                   "0.16.1 has no logit soft-capping)")
    if cfg.get("use_bidirectional_attention"):
        raise GemmaConfigError("config.json use_bidirectional_attention=true is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise GemmaConfigError(f"config.json hidden_activation={act!r} is not supported "
                               "(only gelu_pytorch_tanh)")
    _, _, local_theta = rope_settings(cfg)
    types = layer_types(cfg)
    window = int(cfg.get("sliding_window") or 0)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    out = dict(
        kv_channels=head_dim,
        activation_func=partial(F.gelu, approximate="tanh"),
        qk_layernorm=True,
        softmax_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        local_rotary_base=local_theta,
        add_qkv_bias=False,
    )
    if "sliding_attention" in types:
        if window < 1:
            raise GemmaConfigError("config.json: sliding layers need sliding_window >= 1")
        out.update(window_size=(window - 1, 0),
                   window_attn_skip_freq=[int(t == "sliding_attention") for t in types])
    return out


def block_spec(config, use_te: bool, vp_stage: int | None, patch_local):
    """Local layer spec of Gemma 3 (`use_te` must be False)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if use_te:
        raise GemmaConfigError(LOCAL_ONLY)
    spec = patch_local(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
                       config)
    sub = spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = GemmaRMSNorm
    attn = sub.self_attention
    attn.module = DualRopeSelfAttention
    attn.submodules.q_layernorm = attn.submodules.k_layernorm = GemmaRMSNorm
    attn.submodules.linear_proj = PostNormRowParallelLinear
    submodules(sub.mlp).linear_fc2 = PostNormRowParallelLinear
    n_local = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * n_local, layer_norm=GemmaRMSNorm)


def gpt_model_kwargs(cfg: dict) -> dict:
    """GPTModel rotary arguments (the global layers' table)."""
    theta, factor, _ = rope_settings(cfg)
    return dict(rotary_base=theta, rope_scaling=False, seq_len_interpolation_factor=factor)


def post_build(model, cfg: dict) -> None:
    """Scale the embedding output by sqrt(hidden_size)."""
    scale_embeddings(model, int(cfg["hidden_size"]))
