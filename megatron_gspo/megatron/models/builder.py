"""Megatron-Core GPTModel built from a Hugging Face `config.json` (no weights).

Supported architectures (`SUPPORTED_ARCHITECTURES`): LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Qwen3MoeForCausalLM: RMSNorm, SwiGLU, RoPE (theta, llama3 scaling), GQA,
tied or untied embeddings, Qwen2 QKV bias, Qwen3 q/k RMSNorm, Qwen3-MoE experts (top-k softmax
router, `norm_topk_prob`, `moe_intermediate_size`).

Layer spec: Transformer Engine when `transformer_engine` imports (GPU), the local Megatron-Core
spec otherwise (CPU / no TE), or forced with `use_te=True/False`.

Parameter names of the built model (what checkpoint converters map Hugging Face tensors onto).
`i` is the layer index LOCAL to the pipeline stage / virtual chunk (global index = i +
`layer_offset(...)`), `j` the expert index local to the expert-parallel rank (global = j +
ep_rank * num_experts / ep_size). Shapes are per TP rank.

  embedding.word_embeddings.weight                     [V_pad/tp, H]   (first stage)
  decoder.layers.i.input_layernorm.weight              [H]             (local spec)
  decoder.layers.i.self_attention.linear_qkv.layer_norm_weight  [H]    (TE spec, replaces ^)
  decoder.layers.i.self_attention.linear_qkv.weight    [(nq+2*nkv)*d/tp, H]
      rows grouped per KV group: for each group g: its nq/nkv query heads, then k_g, then v_g
  decoder.layers.i.self_attention.linear_qkv.bias      (Qwen2 only, same row layout)
  decoder.layers.i.self_attention.q_layernorm.weight   [d]             (Qwen3 / Qwen3-MoE)
  decoder.layers.i.self_attention.k_layernorm.weight   [d]
  decoder.layers.i.self_attention.linear_proj.weight   [H, nq*d/tp]
  dense MLP:
  decoder.layers.i.pre_mlp_layernorm.weight            [H]             (local spec)
  decoder.layers.i.mlp.linear_fc1.layer_norm_weight    [H]             (TE spec, replaces ^)
  decoder.layers.i.mlp.linear_fc1.weight               [2*F/tp, H]  = [gate shard; up shard]
  decoder.layers.i.mlp.linear_fc2.weight               [H, F/tp]
  MoE MLP (pre_mlp_layernorm stays a separate module in both specs):
  decoder.layers.i.pre_mlp_layernorm.weight            [H]
  decoder.layers.i.mlp.router.weight                   [E, H]
  decoder.layers.i.mlp.experts.local_experts.j.linear_fc1.weight  [2*Fe/etp, H]  (local spec)
  decoder.layers.i.mlp.experts.local_experts.j.linear_fc2.weight  [H, Fe/etp]
  decoder.layers.i.mlp.experts.linear_fc1.weight<j>    (TE grouped GEMM, same shapes)
  decoder.layers.i.mlp.experts.linear_fc2.weight<j>
  decoder.final_layernorm.weight                       [H]             (last stage)
  output_layer.weight                                  [V_pad/tp, H]   (last stage, untied only;
      with tied embeddings the last stage holds a copy of the embedding under this name when
      PP > 1, kept in sync by Megatron)

The vocabulary is padded to `padded_vocab_size(V, 128, tp)` rows, a multiple of lcm(128, tp)
(zeros in converted checkpoints); the learner's log-probs mask the padded columns out.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_gspo.megatron.models import deepseek_v3
from megatron_gspo.megatron.models import deepseek_v32
from megatron_gspo.megatron.models import gemma3
from megatron_gspo.megatron.models import glm4_moe
from megatron_gspo.megatron.models import glm_moe_dsa
from megatron_gspo.megatron.models import gpt_oss
from megatron_gspo.megatron.models import qwen3_5
from megatron_gspo.megatron.models import qwen3_next
from megatron_gspo.megatron.models import mtp_block as mtp_models
from megatron_gspo.megatron.compat import submodules
from megatron_gspo.megatron.fallbacks import bind_missing_te_names, te_available
from megatron_gspo.megatron.models.local_layers import (PackedDotProductAttention,
                                                         SequenceParallelRMSNorm)
from megatron_gspo.megatron.models.padding_idx import keep_pad_row_frozen, pad_id_of
from megatron_gspo.megatron.models.te_conditions import te_build_problems

bind_missing_te_names()  # the MoE router without Transformer Engine (GPU or CPU)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    deepseek_v3.ARCHITECTURE,
    deepseek_v32.ARCHITECTURE,
    gemma3.ARCHITECTURE,
    glm4_moe.ARCHITECTURE,
    glm_moe_dsa.ARCHITECTURE,
    gpt_oss.ARCHITECTURE,
    qwen3_next.ARCHITECTURE,
    *qwen3_5.ARCHITECTURES,
)
# families whose config fields and layer specs live in a module of their own
_FAMILIES = {a: m for m in (deepseek_v3, deepseek_v32, gemma3, glm4_moe, glm_moe_dsa, gpt_oss,
                            qwen3_next, qwen3_5)
             for a in getattr(m, "ARCHITECTURES", (m.ARCHITECTURE,))}
# known architectures a family refuses with its own one-line reason
_REFUSED = {a: why for m in set(_FAMILIES.values()) for a, why in getattr(m, "REFUSED", {}).items()}


def _resolve_te(hf_config: dict, use_te: bool | None) -> bool:
    """The spec to build: `use_te`, or (None) TE when importable, except for families that
    have a local spec only (Gemma 3; forcing TE there is their one-line error)."""
    if use_te is not None:
        return use_te
    family = _FAMILIES.get((hf_config.get("architectures") or [None])[0])
    return te_available() and not getattr(family, "LOCAL_ONLY", None)
_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
VOCAB_PAD_MULTIPLE = 128


class ModelConfigError(ValueError):
    """A Hugging Face config this builder cannot express."""


def architecture_of(hf_config: dict) -> str:
    """The single supported architecture named in `hf_config['architectures']`."""
    archs = hf_config.get("architectures") or []
    if len(archs) == 1 and archs[0] in _REFUSED:
        raise ModelConfigError(_REFUSED[archs[0]])
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"config.json architectures={archs!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_PAD_MULTIPLE,
                      tensor_parallel: int = 1) -> int:
    """Vocabulary rows of the embedding / output layer: `vocab_size` rounded up to a multiple
    of lcm(`multiple`, `tensor_parallel`) -- the same for every TP size dividing `multiple`, so
    full weights and checkpoints do not depend on the layout."""
    m = math.lcm(int(multiple), int(tensor_parallel))
    return int(math.ceil(vocab_size / m) * m)


def _need(hf_config: dict, key: str) -> Any:
    if key not in hf_config or hf_config[key] is None:
        raise ModelConfigError(f"config.json is missing required field {key!r}")
    return hf_config[key]


def _rope_settings(hf_config: dict) -> tuple[float, bool, float]:
    """(rotary_base, llama3 scaling on/off, scaling factor) from the HF rope fields."""
    rope_params = hf_config.get("rope_parameters") or {}
    theta = hf_config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling = hf_config.get("rope_scaling") or (
        rope_params if rope_params.get("rope_type", "default") != "default" else None
    )
    if not scaling:
        return float(theta), False, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return float(theta), False, 1.0
    if kind != "llama3":
        raise ModelConfigError(f"config.json rope_scaling type {kind!r} is not supported "
                               "(supported: default, llama3)")
    expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    for key, want in expected.items():
        if key in scaling and float(scaling[key]) != want:
            raise ModelConfigError(f"config.json rope_scaling.{key}={scaling[key]} unsupported "
                                   f"(Megatron-Core's llama3 scaling uses {want})")
    return float(theta), True, float(scaling.get("factor", 8.0))


def build_model_config(
    hf_config: dict,
    *,
    params_dtype: torch.dtype = torch.float32,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_pipeline: int | None = None,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    context_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: bool = False,
    moe_aux_loss_coeff: float = 0.0,
    use_te: bool | None = None,
    **overrides: Any,
) -> TransformerConfig:
    """TransformerConfig equivalent to a Hugging Face config.

    Args:
        hf_config: parsed `config.json`.
        params_dtype: parameter / compute dtype (float32, bfloat16, float16).
        tensor_parallel..sequence_parallel: parallel layout (must match parallel_state).
        recompute: full activation recompute of every layer.
        moe_aux_loss_coeff: load-balancing loss coefficient (0 = none, the RL default).
        use_te: force the TE (True) or local (False) spec; None = TE if importable.
        overrides: extra TransformerConfig fields (applied last).
    Returns:
        TransformerConfig.
    """
    arch = architecture_of(hf_config)
    family = _FAMILIES.get(arch)
    if family is None:
        _rope_settings(hf_config)  # validate early; used by build_gpt_model
    use_te = _resolve_te(hf_config, use_te)
    hidden = int(_need(hf_config, "hidden_size"))
    heads = int(_need(hf_config, "num_attention_heads"))
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"config.json hidden_act={act!r} unsupported (only silu/SwiGLU)")
    if hf_config.get("attention_bias") and arch not in (
            "Qwen2ForCausalLM", glm4_moe.ARCHITECTURE, gpt_oss.ARCHITECTURE):
        raise ModelConfigError("config.json attention_bias=true is only supported for Qwen2, "
                               "GLM-4.5 MoE and gpt-oss")
    if hf_config.get("mlp_bias"):
        raise ModelConfigError("config.json mlp_bias=true is not supported")
    if hf_config.get("use_sliding_window"):
        raise ModelConfigError("config.json use_sliding_window=true is not supported")
    if heads % kv_heads:
        raise ModelConfigError(f"num_attention_heads={heads} not divisible by "
                               f"num_key_value_heads={kv_heads}")
    fp16 = params_dtype == torch.float16
    bf16 = params_dtype == torch.bfloat16
    kw: dict[str, Any] = dict(
        num_layers=int(_need(hf_config, "num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        ffn_hidden_size=int(hf_config.get("intermediate_size") or 4 * hidden),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf_config.get("attention_bias")),
        qk_layernorm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(hf_config.get("initializer_range", 0.02)),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        fp16=fp16,
        bf16=bf16,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
        context_parallel_size=context_parallel,
        sequence_parallel=sequence_parallel and tensor_parallel > 1,
        # Fused kernels that need apex / TE / custom CUDA ops are off unless TE is used.
        masked_softmax_fusion=False,
        bias_activation_fusion=use_te,
        bias_dropout_fusion=use_te,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        # Pipeline stages exchange fixed-shape activations (the learner pads the micro-batches
        # of a step to one length): shape exchange deadlocks the interleaved schedule.
        variable_seq_lengths=False,
        moe_token_dispatcher_type="alltoall",
        deallocate_pipeline_outputs=True,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if arch in _MOE_ARCHITECTURES:
        step = int(hf_config.get("decoder_sparse_step", 1))
        if step != 1 or hf_config.get("mlp_only_layers"):
            raise ModelConfigError("config.json decoder_sparse_step != 1 / mlp_only_layers "
                                   "(mixed dense and MoE layers) is not supported")
        norm_topk = bool(hf_config.get("norm_topk_prob", False))
        kw.update(
            num_moe_experts=int(_need(hf_config, "num_experts")),
            moe_router_topk=int(_need(hf_config, "num_experts_per_tok")),
            moe_ffn_hidden_size=int(_need(hf_config, "moe_intermediate_size")),
            moe_router_score_function="softmax",
            # softmax over all experts then top-k (no renormalisation) == pre_softmax=True;
            # norm_topk_prob renormalises the top-k weights == softmax over the top-k.
            moe_router_pre_softmax=not norm_topk,
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_grouped_gemm=use_te,
            moe_router_dtype="fp32",
        )
    config_cls = TransformerConfig
    if family is not None:
        try:
            kw.update(family.config_fields(hf_config, use_te))
        except ValueError as e:
            raise ModelConfigError(str(e)) from None
        config_cls = family.CONFIG_CLASS
        if kw.get("num_moe_experts"):
            kw.update(moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0
                      else "none", moe_aux_loss_coeff=moe_aux_loss_coeff)
    kw.update(overrides)
    config = config_cls(**kw)
    for problem in te_build_problems(config) if use_te else ():
        raise ModelConfigError(f"{arch} on the Transformer Engine spec: {problem}")
    return config


def _layer_spec(config: TransformerConfig, use_te: bool) -> ModuleSpec:
    num_experts = config.num_moe_experts
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=bool(num_experts),
            qk_layernorm=config.qk_layernorm)
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
        normalization="RMSNorm")
    return _patch_local(spec, config)


def _patch_local(spec: ModuleSpec, config: TransformerConfig) -> ModuleSpec:
    """Put this package's local modules into a local layer spec: packed-sequence attention,
    and sequence-parallel-aware RMSNorms (norms of MLA's q / kv latents included)."""
    attn = submodules(spec.submodules.self_attention)
    attn.core_attention = PackedDotProductAttention
    if config.sequence_parallel:
        sub = spec.submodules
        sub.input_layernorm = SequenceParallelRMSNorm
        sub.pre_mlp_layernorm = SequenceParallelRMSNorm
        for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
            # the torch norm refuses SP even where it sees whole heads / latents
            if config.qk_layernorm and hasattr(attn, name):
                setattr(attn, name, SequenceParallelRMSNorm)
    return spec


def build_gpt_model(
    hf_config: dict,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    config: TransformerConfig | None = None,
    use_te: bool | None = None,
    max_sequence_length: int | None = None,
    vocab_multiple: int = VOCAB_PAD_MULTIPLE,
    mtp: bool = False,
    **config_kwargs: Any,
) -> GPTModel:
    """GPTModel for one pipeline stage (or virtual chunk) of the HF architecture.

    Args:
        hf_config: parsed `config.json`.
        pre_process / post_process: this chunk holds the embedding / the output layer.
        vp_stage: virtual pipeline chunk index (None without VPP).
        config: a TransformerConfig from `build_model_config` (built here from
            `config_kwargs` when None).
        use_te: force the TE (True) or local (False) spec; None = TE if importable.
        max_sequence_length: rotary table size (default max_position_embeddings).
        vocab_multiple: pad the vocabulary to a multiple of lcm(this, TP).
        mtp: also build the config's ``num_nextn_predict_layers`` multi-token-prediction
            layers, frozen, as ``model.mtp`` (`models.mtp_block.attach_mtp`; the policy forward
            does not run them).
    Returns:
        GPTModel (unwrapped, fp32/bf16 params as configured).
    """
    use_te = _resolve_te(hf_config, use_te)
    if config is None:
        config = build_model_config(hf_config, use_te=use_te, **config_kwargs)
    family = _FAMILIES.get(architecture_of(hf_config))
    rope = {}
    if family is None:
        theta, rope_scaling, rope_factor = _rope_settings(hf_config)
        rope = dict(rotary_base=theta, rope_scaling=rope_scaling, rope_scaling_factor=rope_factor)
    elif hasattr(family, "gpt_model_kwargs"):
        rope = family.gpt_model_kwargs(hf_config)  # (MLA layers build their own rope)
    if family is not None:
        spec = family.block_spec(config, use_te, vp_stage, _patch_local)
    else:
        spec = _layer_spec(config, use_te)
    if family is None and config.sequence_parallel and not use_te:
        # final layernorm comes from the block spec; route it through the SP-aware norm too.
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        n_local = get_num_layers_to_build(config, vp_stage=vp_stage)
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * n_local, layer_norm=SequenceParallelRMSNorm)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(int(_need(hf_config, "vocab_size")), vocab_multiple,
                                     config.tensor_model_parallel_size),
        max_sequence_length=int(max_sequence_length
                                or hf_config.get("max_position_embeddings", 4096)),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        vp_stage=vp_stage,
        **rope,
    )
    if hasattr(family, "post_build"):
        family.post_build(model, hf_config)
    model.mtp_layers = mtp_models.num_mtp_layers(hf_config, mtp)  # on every stage
    if model.mtp_layers:
        mtp_models.attach_mtp(model, config, spec, use_te, model.mtp_layers, vp_stage)
    pad = pad_id_of(hf_config, int(_need(hf_config, "vocab_size")))
    if pre_process and pad is not None:  # transformers' padding_idx
        keep_pad_row_frozen(model.embedding.word_embeddings, pad)
    return model


def config_summary(config: TransformerConfig) -> dict:
    """Small dict of the config fields worth logging."""
    keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
            "kv_channels", "ffn_hidden_size", "num_moe_experts", "moe_router_topk",
            "qk_layernorm", "add_qkv_bias", "params_dtype")
    d = {k: getattr(config, k) for k in keys}
    d["params_dtype"] = str(d["params_dtype"])
    return d


def layer_offset(config: TransformerConfig, vp_stage: int | None = None) -> int:
    """Global index of this pipeline stage's (chunk's) first layer."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return int(get_transformer_layer_offset(config, vp_stage=vp_stage))
