"""Weight quantization for the rollout engines (pure torch): block-wise FP8 (DeepSeek-V3,
arXiv 2412.19437; SGLang's "fp8" method with 128 x 128 blocks) in `blockfp8`, and the HF
checkpoint converter built on it in `fp8_checkpoint`."""

from megatron_gspo.quant.blockfp8 import (
    dequantize,
    is_quantized,
    modules_to_not_convert,
    quantization_config,
    quantize,
    quantized_names,
)

__all__ = ["dequantize", "is_quantized", "modules_to_not_convert", "quantization_config",
           "quantize", "quantized_names"]
