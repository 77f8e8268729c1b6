"""gpt-oss (GptOssForCausalLM) in Megatron-Core 0.16.1: HF config -> TransformerConfig fields
and the layer spec.

What maps onto what (transformers' `modeling_gpt_oss.py` vs Megatron-Core):
- attention sinks (`self_attn.sinks`, one logit per head joined to each softmax row and dropped
  after it) -> `softmax_type="learnable"` (`core_attention.softmax_offset`, split over TP by head);
- alternating sliding / full layers (`layer_types`, `sliding_window`) -> `window_size=(W-1, 0)`
  with a per-layer `window_attn_skip_freq` list;
- YaRN rope (`rope_parameters`: factor, beta_fast / beta_slow, original_max_position_embeddings,
  `truncate=false` -> no integer rounding of the correction range) -> GPTModel's
  `YarnRotaryEmbedding`. transformers multiplies cos / sin by the attention factor
  0.1 ln(factor) + 1, GPTModel drops the factor it returns: it is folded into
  `softmax_scale = factor^2 / sqrt(head_dim)` (rope covers the whole head, so q.k scales by
  factor^2 in transformers; the sinks are not scaled in either);
- q/k/v/o biases, router bias, expert biases -> `add_bias_linear=True`, `add_qkv_bias=True`;
- router: top-k of the logits, softmax over the k (`moe_router_pre_softmax=False`);
- experts: clamped SwiGLU `(clamp(up, +-limit) + 1) * g * sigmoid(alpha g)`, g = clamp(gate, max
  = limit) -> `activation_func=quick_gelu` (alpha 1.702), `activation_func_clamp_value=limit`,
  `glu_linear_offset=1`. transformers interleaves gate / up columns of `gate_up_proj`
  [E, H, 2F]; the adapter de-interleaves them into Megatron's [gate; up] rows.

Refused (one-line errors): `swiglu_alpha` other than 1.702 (Megatron-Core's quick_gelu has the
constant built in), rope types other than yarn / default, MXFP4-quantized checkpoints (the
adapter: dequantize to bf16 first), and the Transformer Engine spec is written against
`get_gpt_layer_with_transformer_engine_spec` but untested here (no GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.core.activations import quick_gelu
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel.layers import (
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megatron_gspo.megatron.compat import submodules

ARCHITECTURE = "GptOssForCausalLM"


class GptOssConfigError(ValueError):
    """A gpt-oss config field this build of Megatron-Core cannot express."""


@dataclass
class GptOssTransformerConfig(TransformerConfig):
    """TransformerConfig plus the YaRN fields GPTModel reads for `position_embedding_type="yarn"`
    (Megatron-Core 0.16.1 reads them with getattr and defines them nowhere)."""

    position_embedding_type: str = "rope"
    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True


CONFIG_CLASS = GptOssTransformerConfig


def _rope(cfg: dict) -> tuple[float, dict, float]:
    """(rotary base, config fields, q.k scale factor of the rope attention factor)."""
    rp = dict(cfg.get("rope_parameters") or {})
    rp.update(cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or rp.get("rope_theta") or 150000.0)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return theta, {"position_embedding_type": "rope"}, 1.0
    if kind != "yarn":
        raise GptOssConfigError(f"config.json rope type {kind!r} is not supported for "
                                f"{ARCHITECTURE} (default or yarn)")
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if rp.get(key) is not None:
            raise GptOssConfigError(f"config.json rope {key} is not supported for {ARCHITECTURE}")
    factor = float(rp["factor"])
    attn = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    fields = dict(
        position_embedding_type="yarn", yarn_rotary_scaling_factor=factor,
        yarn_original_max_position_embeddings=int(rp.get("original_max_position_embeddings")
                                                  or 4096),
        yarn_beta_fast=float(rp.get("beta_fast", 32.0)),
        yarn_beta_slow=float(rp.get("beta_slow", 1.0)),
        yarn_mscale=1.0, yarn_mscale_all_dim=1.0,  # -> GPTModel's factor 1 (dropped anyway)
        yarn_correction_range_round_to_int=rp.get("truncate", True) is not False)
    return theta, fields, attn * attn


def config_fields(cfg: dict, use_te: bool) -> dict:
    """TransformerConfig fields of gpt-oss on top of the dense defaults."""
    alpha = float(cfg.get("swiglu_alpha", 1.702))
    if alpha != 1.702:
        raise GptOssConfigError(f"config.json swiglu_alpha={alpha} is not supported "
                                "(Megatron-Core 0.16.1's quick_gelu uses 1.702)")
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise GptOssConfigError(f"config.json layer_types {types!r} do not fit {n} layers")
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    _, rope, qk_scale = _rope(cfg)
    out = dict(
        kv_channels=head_dim,
        add_bias_linear=bool(cfg.get("attention_bias", True)),
        add_qkv_bias=bool(cfg.get("attention_bias", True)),
        softmax_type="learnable",
        softmax_scale=qk_scale / math.sqrt(head_dim),
        activation_func=quick_gelu,
        activation_func_clamp_value=float(cfg.get("swiglu_limit", 7.0)),
        glu_linear_offset=1.0,
        bias_activation_fusion=False,
        # TEGroupedMLP (the TE spec's grouped-GEMM experts, megatron-core transformer/moe/
        # experts.py) asserts not (add_bias_linear and bias_dropout_fusion)
        bias_dropout_fusion=False,
        num_moe_experts=int(cfg["num_local_experts"]),
        moe_router_topk=int(cfg["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(cfg["intermediate_size"]),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,  # top-k of the logits, softmax over the k
        moe_router_dtype="fp32",
        moe_grouped_gemm=use_te,
        **rope,
    )
    if "sliding_attention" in types:
        out.update(window_size=(int(cfg["sliding_window"]) - 1, 0),
                   window_attn_skip_freq=[int(t == "sliding_attention") for t in types])
    return out


def gpt_model_kwargs(cfg: dict) -> dict:
    """GPTModel rotary base (the YaRN fields travel in the config)."""
    theta, _, _ = _rope(cfg)
    return dict(rotary_base=theta)


class CopyOutRowParallelLinear(RowParallelLinear):
    """The experts' fc2 of the local spec, returning a fresh output tensor: Megatron-Core
    0.16.1's MLP adds an expert's bias in place (`output += output_bias * per_token_scale`) to
    what RowParallelLinear returns, which with an expert-TP group of one is a view made by a
    custom autograd Function, and autograd refuses the in-place add in training."""

    def forward(self, input_):
        out, bias = super().forward(input_)
        return out.clone(), bias


def block_spec(config, use_te: bool, vp_stage: int | None, patch_local):
    """Every layer is an MoE layer; local or TE spec."""
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=True)
        from megatron.core.extensions.transformer_engine import TENorm as norm
    else:
        spec = patch_local(get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False,
            normalization="RMSNorm"), config)
        submodules(submodules(spec.submodules.mlp).experts).linear_fc2 = CopyOutRowParallelLinear
        norm = spec.submodules.input_layernorm
    n_local = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * n_local, layer_norm=norm)


def post_build(model, cfg: dict) -> None:
    """Parameter attributes Megatron-Core 0.16.1 leaves wrong for gpt-oss:
    - the sinks (`softmax_offset`, one per local head) are split over TP on dim 0: marked so
      the learner's sharding, gradient norm and checkpoints treat them as tensor-parallel;
    - the experts' fc2 biases (RowParallelLinear biases) are marked `sequence_parallel` under
      SP, so their gradients were summed over the TP group, whose ranks hold other experts
      under EP (measured: expert e's bias gradient added to expert e + E/2's). Unmarked: each
      expert's gradient is complete on the rank that holds it."""
    for name, p in model.named_parameters():
        if name.endswith("core_attention.softmax_offset"):
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        if ".experts." in name and ".linear_fc2.bias" in name:
            p.sequence_parallel = False
