"""State-dict adapter for Qwen3 (Qwen3ForCausalLM): Llama layout plus per-head q/k RMSNorm."""

from megatron_gspo.convert.mtp import AddedMTPAdapter
from megatron_gspo.convert.param_map import StateDictAdapter


class Qwen3Adapter(AddedMTPAdapter, StateDictAdapter):
    """Qwen3: ``q_norm``/``k_norm`` map to ``q_layernorm``/``k_layernorm``; no linear biases."""

    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    qk_norm = True
