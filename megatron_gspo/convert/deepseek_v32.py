"""State-dict adapter for DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3's maps
(`convert/deepseek_v3.py`: multi-latent attention, dense then MoE layers) plus each layer's
DeepSeek Sparse Attention indexer, all replicated on every TP rank:

  self_attn.indexer.wq_b [n_idx*d_idx, q_lora] -> self_attention.core_attention.indexer.linear_wq_b
  self_attn.indexer.wk   [d_idx, H]            -> self_attention.core_attention.indexer.linear_wk
  self_attn.indexer.k_norm.{weight,bias} [d_idx] -> ...indexer.k_norm.{weight,bias}
  self_attn.indexer.weights_proj [n_idx, H]    -> ...indexer.linear_weights_proj

(SGLang's `nsa_indexer.py` `Indexer` names the same `wq_b` / `wk` / `k_norm` / `weights_proj`; read
at a snapshot of its main branch, not at the 0.5.23 pin.) Megatron-Core builds DSA layers on
its local spec here (`megatron/models/deepseek_v32.py`, LOCAL_ONLY): no Transformer Engine
spelling. The released checkpoint's multi-token-prediction layer is not converted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megatron_gspo.convert.param_map import ConversionError, ModelDims, ParamMap
from megatron_gspo.convert.deepseek_v3 import DeepseekV3Adapter, MLADims


@dataclass(frozen=True)
class DSADims(MLADims):
    """MLADims plus the DSA indexer's sizes."""

    index_n_heads: int = 0
    index_head_dim: int = 0


class DeepseekV32Adapter(DeepseekV3Adapter):
    """DeepSeek-V3.2 (-Exp): DeepSeek-V3 plus the lightning indexer of every layer."""

    architectures = ("DeepseekV32ForCausalLM",)
    model_types = ("deepseek_v32",)

    def check_config(self, cfg: Mapping) -> None:
        super().check_config(cfg)
        for key in ("q_lora_rank", "index_n_heads", "index_head_dim", "index_topk"):
            if not cfg.get(key):
                raise ConversionError(f"config.json: missing required field '{key}' "
                                      f"({self.architectures[0]})")

    def dims(self, cfg: Mapping) -> DSADims:
        base = super().dims(cfg)
        fields = {k: getattr(base, k) for k in MLADims.__dataclass_fields__}
        return DSADims(**fields, index_n_heads=int(cfg["index_n_heads"]),
                       index_head_dim=int(cfg["index_head_dim"]))

    def has_indexer(self, i: int, d: DSADims) -> bool:
        """Layer i runs its own indexer (every layer of DeepSeek-V3.2)."""
        return True

    def attention_maps(self, i: int, d: DSADims) -> list[ParamMap]:
        maps = super().attention_maps(i, d)
        if not self.has_indexer(i, d):
            return maps
        h = f"model.layers.{i}.self_attn.indexer."
        m = f"decoder.layers.{i}.self_attention.core_attention.indexer."
        n, k, H = d.index_n_heads, d.index_head_dim, d.hidden_size
        return maps + [
            ParamMap(m + "linear_wq_b.weight", (h + "wq_b.weight",),
                     shapes=((n * k, d.q_lora_rank),)),
            ParamMap(m + "linear_wk.weight", (h + "wk.weight",), shapes=((k, H),)),
            ParamMap(m + "k_norm.weight", (h + "k_norm.weight",), shapes=((k,),)),
            ParamMap(m + "k_norm.bias", (h + "k_norm.bias",), shapes=((k,),)),
            ParamMap(m + "linear_weights_proj.weight", (h + "weights_proj.weight",),
                     shapes=((n, H),)),
        ]

    def spell(self, canonical: str, dims: ModelDims, spec: str) -> str:
        if spec != "local":
            raise ConversionError(f"{self.architectures[0]} has the local layer spec only "
                                  f"(got '{spec}')")
        return canonical
