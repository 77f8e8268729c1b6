"""State-dict adapter for DeepSeek-V3 (DeepseekV3ForCausalLM): multi-latent attention (MLA),
leading dense layers, then MoE layers with one shared expert and a sigmoid router whose expert
bias (``e_score_correction_bias``) picks the top-k inside the best groups.

HF -> Megatron-Core names per layer i (canonical = local spec):

  input_layernorm                          -> input_layernorm
  self_attn.q_a_proj     [q_lora, H]       -> self_attention.linear_q_down_proj   (replicated)
  self_attn.q_a_layernorm [q_lora]         -> self_attention.q_layernorm
  self_attn.q_b_proj     [n*(dn+dr), q_lora] -> self_attention.linear_q_up_proj  (TP dim 0)
  self_attn.q_proj (q_lora_rank null)      -> self_attention.linear_q_proj       (TP dim 0)
  self_attn.kv_a_proj_with_mqa [kv_lora+dr, H] -> self_attention.linear_kv_down_proj (replicated)
  self_attn.kv_a_layernorm [kv_lora]       -> self_attention.kv_layernorm
  self_attn.kv_b_proj    [n*(dn+dv), kv_lora] -> self_attention.linear_kv_up_proj (TP dim 0)
  self_attn.o_proj                         -> self_attention.linear_proj         (TP dim 1)
  post_attention_layernorm                 -> pre_mlp_layernorm
  dense layers (i < first_k_dense_replace): mlp.{gate,up,down}_proj -> mlp.linear_fc1/fc2
  MoE layers: mlp.gate.weight -> mlp.router.weight, mlp.gate.e_score_correction_bias ->
  mlp.router.expert_bias (a buffer), mlp.experts.{e}.* -> mlp.experts.local_experts.{e}.*,
  mlp.shared_experts.* -> mlp.shared_experts.linear_fc1 ([gate; up]) / linear_fc2.

The down projections are replicated on every TP rank in both specs (the Transformer Engine
spec's ``TELinear``, parallel_mode duplicated; the learner's local spec builds the same with
`models/deepseek_v3.replicated_down_projections`). A model built from Megatron-Core's local
spec as it is (column-parallel, split on dim 0) is read from the module type by
`megatron/io/dist_checkpoint.py`. Under TE the q/kv norms are fused into the up
projections (``linear_q_up_proj.layer_norm_weight``); ``input_layernorm`` stays a module.
The multi-token-prediction layers of the released checkpoint (layer index num_hidden_layers,
``num_nextn_predict_layers`` of them) map onto Megatron-Core's ``mtp.layers.{k}.*``
(`convert.mtp`); transformers builds no MTP layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_gspo.convert.param_map import (
    ConversionError,
    ModelDims,
    ParamMap,
    StateDictAdapter,
    dims_from_hf_config,
)
from megatron_gspo.convert.mtp import declared_mtp_layers, mtp_maps, share_vocab_maps


@dataclass(frozen=True)
class MLADims(ModelDims):
    """ModelDims plus the multi-latent-attention and shared-expert sizes."""

    q_lora_rank: int = 0  # 0: no query compression (q_proj)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_dense: int = 0
    shared_ffn: int = 0
    mtp_layers: int = 0  # multi-token-prediction layers after the decoder (convert.mtp)


def _ffn_maps(h: str, m: str, H: int, F: int, expert: bool = False) -> list[ParamMap]:
    return [
        ParamMap(m + "linear_fc1.weight", (h + "gate_proj.weight", h + "up_proj.weight"), "glu",
                 0, expert=expert, shapes=((F, H), (F, H))),
        ParamMap(m + "linear_fc2.weight", (h + "down_proj.weight",), tp_dim=1, expert=expert,
                 shapes=((H, F),)),
    ]


# MLA norms fused into the following linear under the Transformer Engine spec
_MLA_TE = [
    (r"\.self_attention\.q_layernorm\.weight$",
     r".self_attention.linear_q_up_proj.layer_norm_weight"),
    (r"\.self_attention\.kv_layernorm\.weight$",
     r".self_attention.linear_kv_up_proj.layer_norm_weight"),
    (r"(layers\.\d+)\.pre_mlp_layernorm\.weight$", r"\1.mlp.linear_fc1.layer_norm_weight"),
    (r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r".experts.\2.weight\1"),
]


_QKV_A = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$")


class DeepseekV3Adapter(StateDictAdapter):
    """DeepSeek-V3 / V3.1 (and the same layout under DeepseekV2-style MLA with sigmoid routing)."""

    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3",)

    def check_config(self, cfg: Mapping) -> None:
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ConversionError(f"config.json: {key}=true is not supported for "
                                      "DeepseekV3ForCausalLM")
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok"):
            if not cfg.get(key):
                raise ConversionError(f"config.json: missing required field '{key}'")

    def dims(self, cfg: Mapping) -> MLADims:
        self.check_config(cfg)
        base = dims_from_hf_config({**cfg, "num_key_value_heads": cfg["num_attention_heads"],
                                    "head_dim": cfg["qk_rope_head_dim"]})
        fields = {k: getattr(base, k) for k in ModelDims.__dataclass_fields__}
        fields.update(num_experts=int(cfg["n_routed_experts"]),
                      moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]))
        return MLADims(
            **fields,
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            first_dense=int(cfg.get("first_k_dense_replace") or 0),
            shared_ffn=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0),
            mtp_layers=declared_mtp_layers(cfg),
        )

    def param_maps(self, dims: ModelDims) -> list[ParamMap]:
        """The base maps, then the MTP layers' (their shared embedding / head copies joined
        to the main embedding / output-layer maps)."""
        return share_vocab_maps(super().param_maps(dims), dims) + mtp_maps(self, dims)

    def is_moe_layer(self, i: int, dims: ModelDims) -> bool:
        return i >= dims.first_dense

    def attention_maps(self, i: int, d: MLADims) -> list[ParamMap]:
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a, s = h + "self_attn.", m + "self_attention."
        H, n = d.hidden_size, d.num_heads
        qd = d.qk_nope_head_dim + d.qk_rope_head_dim
        maps = [
            ParamMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), shapes=((H,),)),
            ParamMap(s + "linear_kv_down_proj.weight", (a + "kv_a_proj_with_mqa.weight",),
                     shapes=((d.kv_lora_rank + d.qk_rope_head_dim, H),)),
            ParamMap(s + "kv_layernorm.weight", (a + "kv_a_layernorm.weight",),
                     shapes=((d.kv_lora_rank,),)),
            ParamMap(s + "linear_kv_up_proj.weight", (a + "kv_b_proj.weight",), tp_dim=0,
                     shapes=((n * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank),)),
            ParamMap(s + "linear_proj.weight", (a + "o_proj.weight",), tp_dim=1,
                     shapes=((H, n * d.v_head_dim),)),
            ParamMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",),
                     shapes=((H,),)),
        ]
        if d.q_lora_rank:
            maps[1:1] = [
                ParamMap(s + "linear_q_down_proj.weight", (a + "q_a_proj.weight",),
                         shapes=((d.q_lora_rank, H),)),
                ParamMap(s + "q_layernorm.weight", (a + "q_a_layernorm.weight",),
                         shapes=((d.q_lora_rank,),)),
                ParamMap(s + "linear_q_up_proj.weight", (a + "q_b_proj.weight",), tp_dim=0,
                         shapes=((n * qd, d.q_lora_rank),)),
            ]
        else:
            maps.insert(1, ParamMap(s + "linear_q_proj.weight", (a + "q_proj.weight",), tp_dim=0,
                                    shapes=((n * qd, H),)))
        return maps

    def mlp_maps(self, i: int, d: MLADims) -> list[ParamMap]:
        h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        H = d.hidden_size
        if not self.is_moe_layer(i, d):
            return _ffn_maps(h, m, H, d.ffn_hidden_size)
        E = d.num_experts
        maps = [
            ParamMap(m + "router.weight", (h + "gate.weight",), shapes=((E, H),)),
            ParamMap(m + "router.expert_bias", (h + "gate.e_score_correction_bias",),
                     shapes=((E,),)),
        ]
        for e in range(E):
            maps += _ffn_maps(f"{h}experts.{e}.", f"{m}experts.local_experts.{e}.", H,
                              d.moe_ffn_hidden_size, expert=True)
        if d.shared_ffn:
            maps += _ffn_maps(h + "shared_experts.", m + "shared_experts.", H, d.shared_ffn)
        return maps

    def bucket_group(self, hf_name: str, dims: ModelDims) -> tuple[str, int] | None:
        """SGLang 0.5.12's DeepseekV2ForCausalLM.load_weights concatenates ``q_a_proj`` and
        ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj_with_mqa`` from tensors cached within one
        call: a layer's two must travel in one bucket, or neither is loaded."""
        mo = _QKV_A.match(hf_name)
        if mo is None or not dims.q_lora_rank:
            return None
        return f"qkv_a.{mo.group(1)}", 2

    def spell(self, canonical: str, dims: ModelDims, spec: str) -> str:
        if spec == "local":
            return canonical
        if spec != "te":
            raise ConversionError(f"unknown layer spec '{spec}' (expected 'local' or 'te')")
        mo = re.match(r"decoder\.layers\.(\d+)\.", canonical)
        moe = bool(mo) and self.is_moe_layer(int(mo.group(1)), dims)
        for pat, rep in _MLA_TE:
            if moe and "pre_mlp_layernorm" in pat:
                continue
            canonical = re.sub(pat, rep, canonical)
        return canonical
