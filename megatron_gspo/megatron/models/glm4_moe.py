"""GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM) in Megatron-Core 0.16.1: HF config -> TransformerConfig.

The MoE half is DeepSeek-V3's (`deepseek_v3.sigmoid_moe_fields`: sigmoid router with the
`e_score_correction_bias` expert bias, `n_group` / `topk_group`, `routed_scaling_factor`, one
shared expert, `first_k_dense_replace` leading dense layers) and so are its refusals. The
attention is standard GQA: q/k/v biases (`attention_bias`, none on o_proj), optional per-head
q/k RMSNorm (`use_qk_norm`), rotary on the first `partial_rotary_factor` of each head
(`rotary_percent`, rotate-half layout as in transformers). Layer specs: `deepseek_v3.block_spec`
(dense layers, then MoE layers; local or Transformer Engine).
"""

from __future__ import annotations

from megatron.core.transformer import TransformerConfig

from megatron_gspo.megatron.models import deepseek_v3
from megatron_gspo.megatron.models.deepseek_v3 import DeepseekConfigError, block_spec  # noqa: F401

ARCHITECTURE = "Glm4MoeForCausalLM"
CONFIG_CLASS = TransformerConfig


def _rope(cfg: dict) -> tuple[float, float]:
    rp = dict(cfg.get("rope_parameters") or {})
    rp.update(cfg.get("rope_scaling") or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default":
        raise DeepseekConfigError(f"config.json rope type {kind!r} is not supported for "
                                  f"{ARCHITECTURE} (only default)")
    theta = float(cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    percent = float(cfg.get("partial_rotary_factor") or rp.get("partial_rotary_factor") or 0.5)
    return theta, percent


def config_fields(cfg: dict, use_te: bool) -> dict:
    """TransformerConfig fields of GLM-4.5 MoE on top of the dense defaults."""
    _rope(cfg)
    if cfg.get("mlp_bias"):
        raise DeepseekConfigError("config.json mlp_bias=true is not supported")
    return dict(
        add_qkv_bias=bool(cfg.get("attention_bias")),
        qk_layernorm=bool(cfg.get("use_qk_norm")),
        **deepseek_v3.sigmoid_moe_fields(cfg, use_te, ARCHITECTURE),
    )


def gpt_model_kwargs(cfg: dict) -> dict:
    """GPTModel rotary arguments: base and the rotated share of each head."""
    theta, percent = _rope(cfg)
    return dict(rotary_base=theta, rotary_percent=percent, rope_scaling=False)
