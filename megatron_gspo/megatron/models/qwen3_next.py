"""Qwen3-Next (Qwen3NextForCausalLM) in Megatron-Core 0.16.1 / 0.19.2: HF config ->
TransformerConfig fields and the local layer spec.

A hybrid stack (transformers' `modeling_qwen3_next.py`): `layer_types` says, per layer, either
- "linear_attention": Gated DeltaNet (arXiv 2412.06464), Megatron-Core's `GatedDeltaNet`
  (`ssm/gated_delta_net.py` in 0.16.1, `ssm/gated_delta_net/gdn.py` in 0.19.2): in_proj ->
  depthwise causal conv (silu) -> l2-normed q / k -> chunked gated delta rule -> RMSNorm gated
  by silu(z) -> out_proj; its fla kernels are replaced on CPU by `megatron.gdn_kernels`;
- "full_attention": GQA with a sigmoid output gate (`attention_output_gate`: q_proj emits
  [q_h, gate_h] per head), zero-centred q / k norms, rotary on the first
  `partial_rotary_factor` of each head (`rotary_percent`);
and every layer's MLP is MoE (softmax top-k, `norm_topk_prob`) with one shared expert scaled by
sigmoid(x . shared_expert_gate) (`moe_shared_expert_gate`); `mlp_only_layers` are dense.
Norms: input / post-attention / final / q / k are zero-centred, (1 + weight) in fp32
(`gemma_layers.GemmaRMSNorm`, the checkpoint's weight unchanged); the delta-net's output norm is
a plain RMSNorm (weight initialised to ones).

Megatron-Core's own block spec for this (`get_transformer_block_with_experimental_attention_
variant_spec`, models/gpt/experimental_attention_variant_module_specs.py) asserts
`transformer_impl == "transformer_engine"`; the local spec here builds the same per-layer
pattern from local modules. Refused: the Transformer Engine spec (not checked without a GPU),
`attention_bias`, rope types other than default.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_gspo.convert.qwen3_next import layer_types, moe_layers
from megatron_gspo.megatron.models import gdn_kernels
from megatron_gspo.megatron.compat import submodules, version
from megatron_gspo.megatron.models.gemma_layers import GemmaRMSNorm
from megatron_gspo.megatron.models.local_layers import SequenceParallelRMSNorm

ARCHITECTURE = "Qwen3NextForCausalLM"
CONFIG_CLASS = TransformerConfig
LOCAL_ONLY = "Qwen3-Next's Transformer Engine spec (Megatron-Core's experimental block spec) " \
             "is not checked here (no GPU); it uses the local spec"


class Qwen3NextConfigError(ValueError):
    """A Qwen3-Next config field this build cannot express."""


def _rope(cfg: dict) -> tuple[float, float]:
    rp = dict(cfg.get("rope_parameters") or {})
    rp.update(cfg.get("rope_scaling") or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default":
        raise Qwen3NextConfigError(f"config.json rope type {kind!r} is not supported for "
                                   f"{ARCHITECTURE} (only default)")
    theta = float(rp.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    percent = float(rp.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 0.25)
    return theta, percent


def config_fields(cfg: dict, use_te: bool) -> dict:
    """TransformerConfig fields of Qwen3-Next on top of the dense defaults."""
    if use_te:
        raise Qwen3NextConfigError(LOCAL_ONLY)
    if cfg.get("attention_bias"):
        raise Qwen3NextConfigError("config.json attention_bias=true is not supported for "
                                   f"{ARCHITECTURE}")
    need = ["linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
            "linear_num_value_heads"]
    if any(moe_layers(cfg)):
        need += ["num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size"]
    missing = [k for k in need if not isinstance(cfg.get(k), int) or isinstance(cfg[k], bool)]
    if missing:
        raise Qwen3NextConfigError(f"config.json of {ARCHITECTURE} lacks an integer "
                                   f"{missing[0]} (needed by its layers)")
    _rope(cfg)
    types = layer_types(cfg)
    out = dict(
        qk_layernorm=True,
        attention_output_gate=True,
        add_qkv_bias=False,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(t == "linear_attention") for t in types],
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim") or 4),
        linear_key_head_dim=int(cfg["linear_key_head_dim"]),
        linear_value_head_dim=int(cfg["linear_value_head_dim"]),
        linear_num_key_heads=int(cfg["linear_num_key_heads"]),
        linear_num_value_heads=int(cfg["linear_num_value_heads"]),
    )
    pattern = moe_layers(cfg)
    if any(pattern):
        norm_topk = bool(cfg.get("norm_topk_prob", True))
        out.update(
            num_moe_experts=int(cfg["num_experts"]),
            moe_layer_freq=pattern,
            moe_router_topk=int(cfg["num_experts_per_tok"]),
            moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not norm_topk,  # as Qwen3-MoE (builder.py)
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            moe_shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
            moe_shared_expert_gate=True,
            moe_shared_expert_overlap=False,
        )
    return out


class PackedGatedDeltaNet(GatedDeltaNet):
    """GatedDeltaNet over the learner's packed rows (THD, batch 1): each packed sequence (and
    the padding tail) runs on its own, so no state crosses a boundary. Megatron-Core 0.16.1's
    module refuses packed input ("GDN does not support packed sequence for now") and 0.19.2's
    torch rule asserts `cu_seqlens is None`; with fla on 0.19.2 the native varlen path runs.

    Under sequence parallelism a rank holds a slice of the packed row that cuts sequences: the
    row is gathered over TP first (backward: this rank's slice of the gradient, which the
    in-projection's own all-reduce has made whole), the sequences run with the module's
    sequence-parallel switches off (the in-projection copies its input, the out-projection
    all-reduces), and the output is split back to this rank's slice (backward: all-gather)."""

    def forward(self, hidden_states, attention_mask=None, *args, packed_seq_params=None,
                **kwargs):
        native = gdn_kernels.fla_available() and version() >= (0, 19, 0)
        if packed_seq_params is None or native:
            return super().forward(hidden_states, attention_mask, *args,
                                   packed_seq_params=packed_seq_params, **kwargs)
        if hidden_states.shape[1] != 1:
            raise ValueError("packed delta-net input needs batch 1")
        if self.sp_size > 1:
            from megatron.core.tensor_parallel.mappings import (
                gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region)

            tp = self.pg_collection.tp
            full = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=tp)
            with _sequence_parallel_off(self):
                out, bias = self._per_sequence(full, attention_mask, packed_seq_params, *args,
                                               **kwargs)
            return scatter_to_sequence_parallel_region(out, group=tp), bias
        return self._per_sequence(hidden_states, attention_mask, packed_seq_params, *args,
                                  **kwargs)

    def _per_sequence(self, hidden_states, attention_mask, packed_seq_params, *args, **kwargs):
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        bounds = sorted({0, *(int(b) for b in cu.tolist()), hidden_states.shape[0]})
        outs, bias = [], None
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            if lo < hidden_states.shape[0]:
                out, bias = super().forward(hidden_states[lo:hi], attention_mask, *args,
                                            packed_seq_params=None, **kwargs)
                outs.append(out)
        return torch.cat(outs, dim=0), bias


class _sequence_parallel_off:
    """Within: the delta-net module and its two projections as without sequence parallelism
    (`GatedDeltaNet.sp_size`, the linears' `sequence_parallel`), restored on exit."""

    def __init__(self, mod) -> None:
        self.mod = mod

    def __enter__(self):
        m = self.mod
        self.saved = (m.sp_size, m.in_proj.sequence_parallel, m.out_proj.sequence_parallel)
        m.sp_size, m.in_proj.sequence_parallel, m.out_proj.sequence_parallel = 1, False, False

    def __exit__(self, *exc):
        m = self.mod
        m.sp_size, m.in_proj.sequence_parallel, m.out_proj.sequence_parallel = self.saved
        return False


def _gdn_spec() -> ModuleSpec:
    gdn_kernels.bind()  # torch l2norm / causal conv / chunked rule where fla is missing
    return ModuleSpec(
        module=PackedGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear,
                                           out_norm=SequenceParallelRMSNorm,
                                           out_proj=RowParallelLinear),
        params={"bias": False, "conv_bias": False},
    )


def _layer(config, moe: bool, linear: bool, patch_local) -> ModuleSpec:
    spec = patch_local(get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts if moe else None, moe_grouped_gemm=False,
        qk_layernorm=True, normalization="RMSNorm"), config)
    sub = spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = GemmaRMSNorm
    if linear:
        sub.self_attention = _gdn_spec()
    else:
        attn = submodules(sub.self_attention)
        attn.q_layernorm = attn.k_layernorm = GemmaRMSNorm
    return spec


def block_spec(config, use_te: bool, vp_stage: int | None, patch_local):
    """Per-layer local specs of this pipeline stage (`use_te` must be False)."""
    if use_te:
        raise Qwen3NextConfigError(LOCAL_ONLY)
    if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise Qwen3NextConfigError(
            "Qwen3-Next under tensor parallelism needs sequence parallelism: the delta-net's "
            "output norm weight meets only this rank's heads, and Megatron-Core sums a "
            "replicated weight's gradient over TP only when it is marked sequence-parallel")
    if config.context_parallel_size > 1:
        raise Qwen3NextConfigError(
            "Qwen3-Next with context parallelism: the local spec's full-attention layers have "
            "none (Megatron-Core: 'Context parallelism is only supported by "
            "TEDotProductAttention'); 0.16.1's GatedDeltaNet has none either ('Gated delta net "
            "does not support context parallel for now'), 0.19.2's has")
    linear = config.linear_attention_freq
    moe = config.moe_layer_freq if config.num_moe_experts else [0] * config.num_layers
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    n_local = get_num_layers_to_build(config, vp_stage=vp_stage)
    cache: dict = {}
    specs = []
    for i in range(offset, offset + n_local):
        key = (bool(moe[i]), bool(linear[i]))
        if key not in cache:
            cache[key] = _layer(config, *key, patch_local)
        specs.append(copy.deepcopy(cache[key]))
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=GemmaRMSNorm)


def gpt_model_kwargs(cfg: dict) -> dict:
    """GPTModel rotary arguments: base and the rotated share of each head."""
    theta, percent = _rope(cfg)
    return dict(rotary_base=theta, rotary_percent=percent, rope_scaling=False)


def post_build(model, cfg: dict) -> None:
    """Megatron-Core 0.16.1's GatedDeltaNet marks conv1d / dt_bias / A_log tensor-parallel
    without a `partition_dim` (0.19.2 sets it on conv1d): all are split along dim 0."""
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False) and not hasattr(p, "partition_dim"):
            if name.endswith(("conv1d.weight", "conv1d.bias", "dt_bias", "A_log")):
                p.partition_dim = 0
