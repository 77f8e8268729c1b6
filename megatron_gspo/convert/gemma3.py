"""State-dict adapter for Gemma 3 (Gemma3ForCausalLM, text): the Llama layout with q/k norms,
sandwich norms and tied embeddings.

HF -> Megatron-Core names per layer i that differ from Llama's:
  self_attn.{q,k}_norm             -> self_attention.{q,k}_layernorm
  post_attention_layernorm         -> self_attention.linear_proj.post_norm   (after o_proj)
  pre_feedforward_layernorm        -> pre_mlp_layernorm
  post_feedforward_layernorm       -> mlp.linear_fc2.post_norm               (after down_proj)
Norm weights are copied as stored (Gemma's norms scale by 1 + weight in both implementations).
Gemma 3 builds the local layer spec only (`megatron.models.gemma3`), so there is no TE spelling.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_gspo.convert.param_map import ConversionError, ModelDims, ParamMap, StateDictAdapter


class Gemma3Adapter(StateDictAdapter):
    """Gemma 3 text models (1B, and the text tower layout of 4B / 12B / 27B)."""

    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    qk_norm = True

    def check_config(self, cfg: Mapping) -> None:
        if cfg.get("attention_bias"):
            raise ConversionError("config.json: attention_bias=true is not supported for "
                                  "Gemma3ForCausalLM")

    def attention_maps(self, i: int, d: ModelDims) -> list[ParamMap]:
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        H = d.hidden_size
        maps = [pm for pm in super().attention_maps(i, d)
                if pm.mcore != m + "pre_mlp_layernorm.weight"]
        return maps + [
            ParamMap(m + "self_attention.linear_proj.post_norm.weight",
                     (h + "post_attention_layernorm.weight",), shapes=((H,),)),
            ParamMap(m + "pre_mlp_layernorm.weight", (h + "pre_feedforward_layernorm.weight",),
                     shapes=((H,),)),
        ]

    def mlp_maps(self, i: int, d: ModelDims) -> list[ParamMap]:
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        return super().mlp_maps(i, d) + [
            ParamMap(m + "mlp.linear_fc2.post_norm.weight",
                     (h + "post_feedforward_layernorm.weight",), shapes=((d.hidden_size,),)),
        ]

    def spell(self, canonical: str, dims: ModelDims, spec: str) -> str:
        if spec != "local":
            raise ConversionError("Gemma 3 has no Transformer Engine layer spec in Megatron-Core "
                                  "0.16.1 (no post-attention / post-MLP norm); use the local spec")
        return canonical
