"""Hugging Face <-> Megatron-Core checkpoint conversion: adapters, registry, safetensors I/O."""

from megatron_gspo.convert.param_map import (
    ConversionError,
    ModelDims,
    ParamMap,
    StateDictAdapter,
    dims_from_hf_config,
    padded_vocab_size,
)
from megatron_gspo.convert.registry import get_adapter, supported_architectures

__all__ = [
    "ConversionError",
    "ModelDims",
    "ParamMap",
    "StateDictAdapter",
    "dims_from_hf_config",
    "get_adapter",
    "padded_vocab_size",
    "supported_architectures",
]
