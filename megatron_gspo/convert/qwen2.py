"""State-dict adapter for Qwen2 (Qwen2ForCausalLM): Llama layout plus q/k/v projection biases."""

from megatron_gspo.convert.param_map import ConversionError, StateDictAdapter


class Qwen2Adapter(StateDictAdapter):
    """Qwen2: biases on q/k/v (fused into ``linear_qkv.bias``), none elsewhere."""

    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)
    qkv_bias = True

    def check_config(self, cfg):
        if cfg.get("mlp_bias"):
            raise ConversionError(
                "config.json: mlp_bias=true is not supported for Qwen2ForCausalLM"
            )
