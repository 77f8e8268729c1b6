"""State-dict adapter for Llama (LlamaForCausalLM): GQA attention, SwiGLU MLP, RMSNorm."""

from megatron_gspo.convert.mtp import AddedMTPAdapter
from megatron_gspo.convert.param_map import StateDictAdapter


class LlamaAdapter(AddedMTPAdapter, StateDictAdapter):
    """Llama: no linear biases, no q/k norms."""

    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)
