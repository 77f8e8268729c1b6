"""DeepSeek-V3 (DeepseekV3ForCausalLM) in Megatron-Core 0.16.1: HF config -> MLATransformerConfig
fields, and the per-layer spec (leading dense layers, then MoE layers), local or TE.

What maps onto what (transformers' `modeling_deepseek_v3.py` vs Megatron-Core):
- multi-latent attention: `MLASelfAttention` (q_lora_rank / kv_lora_rank / qk_nope_head_dim ->
  qk_head_dim, qk_rope_head_dim -> qk_pos_emb_head_dim, v_head_dim). transformers' default
  `rope_interleave=true` rotates interleaved pairs and returns them de-interleaved; Megatron-Core's
  MLA rope (`multi_latent_attention=True` in `apply_rotary_pos_emb`) does the same.
- YaRN (`rope_parameters.rope_type="yarn"`): `rope_type="yarn"` with factor, beta_fast/slow,
  mscale, mscale_all_dim, original_max_position_embeddings; the softmax scale
  mscale(factor, mscale_all_dim)^2 / sqrt(q_head_dim) is the same in both.
- router: sigmoid scores, `e_score_correction_bias` -> `expert_bias` (added for the choice
  only), `n_group`/`topk_group` -> group-limited top-k, top-k weights renormalised
  (`norm_topk_prob=true`) and scaled by `routed_scaling_factor`.
- `first_k_dense_replace` -> `moe_layer_freq` list; `n_shared_experts` -> one shared expert
  of `n_shared_experts * moe_intermediate_size` (no shared-expert gate).

Refused with a one-line error (what Megatron-Core 0.16.1 cannot express, and why):
- `norm_topk_prob=false`: its sigmoid router always renormalises the top-k weights
  (`topk_routing_with_score_function`);
- `num_experts_per_tok / topk_group != 2`: its group score is the sum of the top
  (topk / group_topk) scores of a group, transformers' the sum of the top 2;
- `rope_interleave=false`: its MLA rope always de-interleaves;
- rope types other than default and yarn (MLA builds only `RotaryEmbedding` and
  `YarnRotaryEmbedding`);
- `scoring_func` other than sigmoid, `topk_method` other than noaux_tc;
- training under tensor parallelism without sequence parallelism (`check_training_layout`).
Under TP the down projections are replicated, as in the TE spec (`replicated_down_projections`).
The expert bias is kept frozen during training (`moe_router_bias_update_rate=0`): the
aux-loss-free balancing update is a pre-training device, and the bias the rollout engine
routes with is the one exported from the learner.
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_gspo.megatron.compat import refusal, submodules

ARCHITECTURE = "DeepseekV3ForCausalLM"


class DeepseekConfigError(ValueError):
    """A DeepSeek-V3 config field this build of Megatron-Core cannot express."""


def _need(cfg: dict, key: str) -> Any:
    if cfg.get(key) is None:
        raise DeepseekConfigError(f"config.json is missing required field {key!r}")
    return cfg[key]


def rope_fields(cfg: dict) -> dict:
    """MLATransformerConfig rope fields from `rope_parameters` / `rope_scaling` / `rope_theta`."""
    rp = dict(cfg.get("rope_parameters") or {})
    rp.update(cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return dict(rope_type="rope", rotary_base=theta, rotary_scaling_factor=1.0,
                    mscale=1.0, mscale_all_dim=0.0)
    if kind != "yarn":
        raise DeepseekConfigError(
            f"config.json rope type {kind!r} is not supported for {ARCHITECTURE} (Megatron-Core "
            "0.16.1's MLA builds only default and yarn rotary embeddings)")
    if rp.get("attention_factor") is not None:
        raise DeepseekConfigError("config.json rope attention_factor is not supported (MLA "
                                  "derives it from mscale / mscale_all_dim)")
    if rp.get("truncate") is False:
        raise DeepseekConfigError("config.json rope truncate=false is not supported (MLA's "
                                  "yarn rounds the correction range to integers)")
    return dict(
        rope_type="yarn", rotary_base=theta, rotary_scaling_factor=float(_need(rp, "factor")),
        original_max_position_embeddings=int(rp.get("original_max_position_embeddings")
                                             or cfg.get("max_position_embeddings") or 4096),
        beta_fast=float(rp.get("beta_fast", 32)), beta_slow=float(rp.get("beta_slow", 1)),
        mscale=float(rp.get("mscale", 1.0)), mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0))


def sigmoid_moe_fields(cfg: dict, use_te: bool, arch: str = ARCHITECTURE) -> dict:
    """MoE fields of the DeepSeek-V3 / GLM-4.5 router and layer pattern: sigmoid scores with the
    `e_score_correction_bias` expert bias, group-limited top-k, renormalised and scaled top-k
    weights, one shared expert, `first_k_dense_replace` leading dense layers.

    Raises DeepseekConfigError (one line) for what Megatron-Core 0.16.1 cannot express.
    """
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise DeepseekConfigError(f"config.json scoring_func={cfg['scoring_func']!r} is not "
                                  f"supported for {arch} (only sigmoid)")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise DeepseekConfigError(f"config.json topk_method={cfg['topk_method']!r} is not "
                                  "supported (only noaux_tc)")
    if cfg.get("norm_topk_prob") is False:
        raise DeepseekConfigError("config.json norm_topk_prob=false is not supported "
                                  "(Megatron-Core 0.16.1's sigmoid router always renormalises)")
    experts = int(_need(cfg, "n_routed_experts"))
    topk = int(_need(cfg, "num_experts_per_tok"))
    groups = int(cfg.get("n_group") or 1)
    group_topk = int(cfg.get("topk_group") or groups)
    if groups > 1 and topk != 2 * group_topk:
        raise DeepseekConfigError(
            f"config.json num_experts_per_tok={topk} with topk_group={group_topk} is not "
            "supported (Megatron-Core 0.16.1 scores a group by its top topk/topk_group experts, "
            "transformers by its top 2)")
    layers = int(_need(cfg, "num_hidden_layers"))
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    if first_dense > layers:
        raise DeepseekConfigError(f"config.json first_k_dense_replace={first_dense} > "
                                  f"num_hidden_layers={layers}")
    shared = int(cfg.get("n_shared_experts") or 0)
    moe_ffn = int(_need(cfg, "moe_intermediate_size"))
    return dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        moe_layer_freq=[0] * first_dense + [1] * (layers - first_dense),
        moe_shared_expert_intermediate_size=moe_ffn * shared if shared else None,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        moe_router_dtype="fp32",
        moe_grouped_gemm=use_te,
    )


def config_fields(cfg: dict, use_te: bool) -> dict:
    """MLATransformerConfig fields that DeepSeek-V3 sets on top of the dense defaults.

    Args:
        cfg: parsed config.json.
        use_te: the TE spec is used (grouped-GEMM experts).
    Returns:
        dict of fields; raises DeepseekConfigError (one line) for what cannot be expressed.
    """
    if cfg.get("rope_interleave") is False:
        raise DeepseekConfigError("config.json rope_interleave=false is not supported "
                                  "(Megatron-Core 0.16.1's MLA rope always de-interleaves)")
    heads = int(_need(cfg, "num_attention_heads"))
    return dict(
        multi_latent_attention=True,
        num_query_groups=heads,
        q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        kv_lora_rank=int(_need(cfg, "kv_lora_rank")),
        qk_head_dim=int(_need(cfg, "qk_nope_head_dim")),
        qk_pos_emb_head_dim=int(_need(cfg, "qk_rope_head_dim")),
        v_head_dim=int(_need(cfg, "v_head_dim")),
        kv_channels=int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]),
        qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm
        **sigmoid_moe_fields(cfg, use_te),
        **rope_fields(cfg),
    )


CONFIG_CLASS = MLATransformerConfig


def check_training_layout(cfg: dict, tensor_parallel: int,
                          sequence_parallel: bool = False) -> None:
    """Refuse training multi-latent attention under tensor parallelism without sequence
    parallelism (one line) on the Megatron-Core releases that have
    `compat.REFUSALS["mla_tensor_parallel"]` (0.16.1-0.19.2).

    TP with SP trains exactly (`replicated_down_projections`; TP2+SP gradients within 3e-8 of one
    process's). Without SP their MLA leaves the shared rope key's (`k_pos_emb`) gradient with
    this rank's heads' part only; Megatron-Core also refuses MoE + TP without SP.
    """
    if tensor_parallel > 1 and not sequence_parallel and \
            (cfg.get("architectures") or [None])[0] == ARCHITECTURE:
        reason = refusal("mla_tensor_parallel")
        if reason is not None:
            raise DeepseekConfigError(
                f"DeepSeek-V3 training with parallel.tensor > 1 needs "
                f"parallel.sequence_parallel=true: {reason}")


def replicated_down_projections(spec):
    """Build MLA's `linear_q_down_proj` / `linear_kv_down_proj` of a local layer spec replicated
    on every TP rank, as Megatron-Core's TE spec does (`backend.linear()`: `TELinear`,
    parallel_mode 'duplicated'), instead of the local spec's column-parallel ones.

    The class is the one `MLASelfAttention` accepts for a replicated down projection
    (`post_training/modelopt/layers.py` `Linear`): its output is not gathered over TP (the
    gather's backward kept only this rank's heads' part of the shared rope key's gradient), and
    its weight carries `sequence_parallel`, so `finalize_model_grads` sums its gradient over TP
    when the input is sequence-sharded; the rope key's gradient is summed by
    `gather_from_sequence_parallel_region`'s backward. Spec entries without MLA are unchanged.
    """
    from megatron.core.post_training.modelopt.layers import Linear

    attn = submodules(spec.submodules.self_attention)
    if hasattr(attn, "linear_kv_down_proj"):
        attn.linear_q_down_proj = Linear
        attn.linear_kv_down_proj = Linear
    return spec


def block_spec(config, use_te: bool, vp_stage: int | None,
               patch_local) -> TransformerBlockSubmodules:
    """This stage's layer specs: dense layers first, MoE layers after (`config.moe_layer_freq`);
    multi-latent attention when `config.multi_latent_attention`, else the standard attention
    with q/k norms when `config.qk_layernorm` (GLM-4.5).

    Args:
        config: the MLATransformerConfig.
        use_te: Transformer Engine spec (True) or the local spec (False).
        vp_stage: virtual pipeline chunk (None without VPP).
        patch_local: callable(spec, config) putting this package's local modules into a local
            spec (packed attention, sequence-parallel norms).
    Returns:
        TransformerBlockSubmodules for the layers this stage builds.
    """
    mla = bool(config.multi_latent_attention)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        dense, moe = (get_gpt_layer_with_transformer_engine_spec(
            num_experts=n, moe_grouped_gemm=bool(n), qk_layernorm=config.qk_layernorm,
            multi_latent_attention=mla) for n in (None, config.num_moe_experts))
        norm = TENorm
    else:
        dense, moe = (replicated_down_projections(patch_local(get_gpt_layer_local_spec(
            num_experts=n, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
            multi_latent_attention=mla, normalization="RMSNorm"), config))
            for n in (None, config.num_moe_experts))
        norm = dense.submodules.input_layernorm
    pattern = [moe if f else dense for f in config.moe_layer_freq]
    start = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=pattern[start:start + count], layer_norm=norm)
