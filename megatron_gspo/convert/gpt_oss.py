"""State-dict adapter for gpt-oss (GptOssForCausalLM, bf16 / fp32 checkpoints).

HF -> Megatron-Core names per layer i that differ from Llama's (every layer is an MoE layer):
  self_attn.{q,k,v}_proj.bias        -> self_attention.linear_qkv.bias (interleaved per group)
  self_attn.o_proj.bias              -> self_attention.linear_proj.bias
  self_attn.sinks [heads]            -> self_attention.core_attention.softmax_offset (TP dim 0)
  mlp.router.{weight,bias}           -> mlp.router.{weight,bias}
  mlp.experts.gate_up_proj [E, H, 2F] (gate / up interleaved along 2F), gate_up_proj_bias [E, 2F]
      -> mlp.experts.local_experts.{e}.linear_fc1.{weight [2F, H], bias} as [gate; up]
  mlp.experts.down_proj [E, F, H], down_proj_bias [E, H]
      -> mlp.experts.local_experts.{e}.linear_fc2.{weight [H, F], bias}
One HF tensor holds all experts of a layer; each Megatron expert takes its slice (kinds
`fused_fc1*`, `fused_fc2`, `slice`) and the export stacks them back. MXFP4-quantized
checkpoints (the released `*_blocks` / `*_scales` tensors) are refused: dequantize them first.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_gspo.convert.param_map import ConversionError, ModelDims, ParamMap, StateDictAdapter


class GptOssAdapter(StateDictAdapter):
    """gpt-oss-20b / -120b layout (dequantized)."""

    architectures = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)
    qkv_bias = True

    def check_config(self, cfg: Mapping) -> None:
        quant = (cfg.get("quantization_config") or {}).get("quant_method")
        if quant:
            raise ConversionError(f"config.json: quantization_config.quant_method={quant!r}: "
                                  "quantized gpt-oss experts cannot be converted; load with "
                                  "Mxfp4Config(dequantize=True) and save in bf16 first")
        if not cfg.get("num_local_experts"):
            raise ConversionError("config.json: missing required field 'num_local_experts'")

    def dims(self, cfg: Mapping) -> ModelDims:
        self.check_config(cfg)
        d = super().dims({**cfg, "attention_bias": False})
        fields = {k: getattr(d, k) for k in ModelDims.__dataclass_fields__}
        fields["moe_ffn_hidden_size"] = int(cfg["intermediate_size"])
        return ModelDims(**fields)

    def is_moe_layer(self, i: int, dims: ModelDims) -> bool:
        return True

    def attention_maps(self, i: int, d: ModelDims) -> list[ParamMap]:
        h, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
        return super().attention_maps(i, d) + [
            ParamMap(m + "linear_proj.bias", (h + "o_proj.bias",), shapes=((d.hidden_size,),)),
            ParamMap(m + "core_attention.softmax_offset", (h + "sinks",), tp_dim=0,
                     shapes=((d.num_heads,),)),
        ]

    def mlp_maps(self, i: int, d: ModelDims) -> list[ParamMap]:
        h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        E, H, F = d.num_experts, d.hidden_size, d.moe_ffn_hidden_size
        x = h + "experts."
        maps = [ParamMap(m + "router.weight", (h + "router.weight",), shapes=((E, H),)),
                ParamMap(m + "router.bias", (h + "router.bias",), shapes=((E,),))]
        for e in range(E):
            me = f"{m}experts.local_experts.{e}."
            maps += [
                ParamMap(me + "linear_fc1.weight", (x + "gate_up_proj",), "fused_fc1", 0,
                         expert=True, shapes=((E, H, 2 * F),), index=e),
                ParamMap(me + "linear_fc1.bias", (x + "gate_up_proj_bias",), "fused_fc1_bias",
                         0, expert=True, shapes=((E, 2 * F),), index=e),
                ParamMap(me + "linear_fc2.weight", (x + "down_proj",), "fused_fc2", 1,
                         expert=True, shapes=((E, F, H),), index=e),
                ParamMap(me + "linear_fc2.bias", (x + "down_proj_bias",), "slice", None,
                         expert=True, shapes=((E, H),), index=e),
            ]
        return maps
