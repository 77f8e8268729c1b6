"""State-dict adapter for Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention, routed experts.

Each HF expert ``mlp.experts.{e}.{gate,up,down}_proj`` maps to Megatron-Core's
``mlp.experts.local_experts.{e}.linear_fc1`` ([gate; up]) and ``linear_fc2``; the router
``mlp.gate.weight`` maps to ``mlp.router.weight``. Qwen3-MoE has no shared expert.
"""

from megatron_gspo.convert.param_map import ConversionError, ModelDims, ParamMap
from megatron_gspo.convert.qwen3 import Qwen3Adapter


class Qwen3MoeAdapter(Qwen3Adapter):
    """Qwen3-MoE with every decoder layer sparse (decoder_sparse_step=1, no mlp_only_layers)."""

    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)

    def check_config(self, cfg):
        super().check_config(cfg)
        if cfg.get("mlp_only_layers"):
            raise ConversionError(
                f"config.json: mlp_only_layers={cfg['mlp_only_layers']} (dense layers inside "
                "Qwen3-MoE) is not supported"
            )
        step = cfg.get("decoder_sparse_step", 1)
        if step not in (None, 1):
            raise ConversionError(
                f"config.json: decoder_sparse_step={step} is not supported (need 1)"
            )
        if not (cfg.get("num_experts") or cfg.get("num_local_experts")):
            raise ConversionError("config.json: Qwen3-MoE config has no num_experts")
        if not cfg.get("moe_intermediate_size"):
            raise ConversionError("config.json: missing required field 'moe_intermediate_size'")

    def is_moe_layer(self, i: int, dims: ModelDims) -> bool:
        return True

    def mlp_maps(self, i: int, d: ModelDims) -> list[ParamMap]:
        h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        H, F = d.hidden_size, d.moe_ffn_hidden_size
        maps = [ParamMap(m + "router.weight", (h + "gate.weight",), shapes=((d.num_experts, H),))]
        for e in range(d.num_experts):
            he, me = f"{h}experts.{e}.", f"{m}experts.local_experts.{e}."
            maps.append(
                ParamMap(
                    me + "linear_fc1.weight",
                    (he + "gate_proj.weight", he + "up_proj.weight"),
                    "glu",
                    0,
                    expert=True,
                    shapes=((F, H), (F, H)),
                )
            )
            maps.append(
                ParamMap(
                    me + "linear_fc2.weight",
                    (he + "down_proj.weight",),
                    tp_dim=1,
                    expert=True,
                    shapes=((H, F),),
                )
            )
        return maps
