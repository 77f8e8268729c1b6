"""State-dict adapter for GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM): Qwen2-style attention (q/k/v
biases fused into ``linear_qkv.bias``), optional q/k norms (``use_qk_norm``), and DeepSeek-V3's
MoE layout (leading dense layers, routed experts, shared expert, router weight plus
``e_score_correction_bias`` -> ``mlp.router.expert_bias``). Transformer Engine spelling: the
standard one (pre-MLP norm fused into fc1 in dense layers only). The multi-token-prediction
layer of the released checkpoints (layer index num_hidden_layers) maps onto Megatron-Core's
``mtp.layers.0.*`` as DeepSeek-V3's does (`convert.mtp`).
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_gspo.convert.param_map import ConversionError, ModelDims, ParamMap, StateDictAdapter
from megatron_gspo.convert.deepseek_v3 import DeepseekV3Adapter, MLADims
from megatron_gspo.convert.mtp import declared_mtp_layers


class Glm4MoeAdapter(DeepseekV3Adapter):
    """GLM-4.5 MoE: GQA attention of the base adapter, DeepSeek-V3's MoE maps."""

    architectures = ("Glm4MoeForCausalLM",)
    model_types = ("glm4_moe",)

    def check_config(self, cfg: Mapping) -> None:
        if cfg.get("mlp_bias"):
            raise ConversionError("config.json: mlp_bias=true is not supported for "
                                  "Glm4MoeForCausalLM")
        for key in ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok"):
            if not cfg.get(key):
                raise ConversionError(f"config.json: missing required field '{key}'")

    def dims(self, cfg: Mapping) -> MLADims:
        self.check_config(cfg)
        self.qkv_bias = bool(cfg.get("attention_bias"))
        self.qk_norm = bool(cfg.get("use_qk_norm"))
        from megatron_gspo.convert.param_map import dims_from_hf_config

        base = dims_from_hf_config(cfg)
        fields = {k: getattr(base, k) for k in ModelDims.__dataclass_fields__}
        fields.update(num_experts=int(cfg["n_routed_experts"]),
                      moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]))
        return MLADims(**fields, first_dense=int(cfg.get("first_k_dense_replace") or 0),
                       shared_ffn=int(cfg["moe_intermediate_size"])
                       * int(cfg.get("n_shared_experts") or 0),
                       mtp_layers=declared_mtp_layers(cfg))

    def attention_maps(self, i: int, d: ModelDims) -> list[ParamMap]:
        return StateDictAdapter.attention_maps(self, i, d)

    def bucket_group(self, hf_name: str, dims: ModelDims) -> tuple[str, int] | None:
        return None

    def spell(self, canonical: str, dims: ModelDims, spec: str) -> str:
        return StateDictAdapter.spell(self, canonical, dims, spec)
