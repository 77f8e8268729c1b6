"""Registry of state-dict adapters keyed by the exact ``architectures`` / ``model_type`` name."""

from __future__ import annotations

from collections.abc import Mapping

from megatron_gspo.convert.param_map import ConversionError, StateDictAdapter
from megatron_gspo.convert.deepseek_v3 import DeepseekV3Adapter
from megatron_gspo.convert.deepseek_v32 import DeepseekV32Adapter
from megatron_gspo.convert.gemma3 import Gemma3Adapter
from megatron_gspo.convert.glm4_moe import Glm4MoeAdapter
from megatron_gspo.convert.glm_moe_dsa import GlmMoeDsaAdapter
from megatron_gspo.convert.gpt_oss import GptOssAdapter
from megatron_gspo.convert.llama import LlamaAdapter
from megatron_gspo.convert.qwen2 import Qwen2Adapter
from megatron_gspo.convert.qwen3 import Qwen3Adapter
from megatron_gspo.convert.qwen3_moe import Qwen3MoeAdapter
from megatron_gspo.convert.qwen3_5 import Qwen3_5Adapter, Qwen3_5MoeAdapter
from megatron_gspo.convert.qwen3_next import Qwen3NextAdapter

_ADAPTERS: tuple[type[StateDictAdapter], ...] = (
    LlamaAdapter,
    Qwen2Adapter,
    Qwen3Adapter,
    Qwen3MoeAdapter,
    DeepseekV3Adapter,
    DeepseekV32Adapter,
    Gemma3Adapter,
    Glm4MoeAdapter,
    GlmMoeDsaAdapter,
    GptOssAdapter,
    Qwen3NextAdapter,
    Qwen3_5Adapter,
    Qwen3_5MoeAdapter,
)


def supported_architectures() -> list[str]:
    """Names accepted in config.json ``architectures``."""
    return [a for cls in _ADAPTERS for a in cls.architectures]


def get_adapter(cfg: Mapping) -> StateDictAdapter:
    """Adapter for a Hugging Face config dict.

    Looks up ``architectures[0]`` by exact name, then ``model_type`` by exact name.

    Args:
        cfg: parsed config.json.
    Returns:
        an adapter instance; raises ConversionError listing the supported architectures.
    """
    archs = cfg.get("architectures") or []
    by_arch = {a: cls for cls in _ADAPTERS for a in cls.architectures}
    by_type = {t: cls for cls in _ADAPTERS for t in cls.model_types}
    if archs and archs[0] in by_arch:
        return by_arch[archs[0]]()
    if not archs and cfg.get("model_type") in by_type:
        return by_type[cfg["model_type"]]()
    refused = {a: why for cls in _ADAPTERS for a, why in getattr(cls, "refused", {}).items()}
    if archs and archs[0] in refused:  # a known checkpoint the learner cannot take as it is
        raise ConversionError(refused[archs[0]])
    got = archs[0] if archs else cfg.get("model_type")
    raise ConversionError(
        f"unsupported architecture '{got}'; supported: {', '.join(supported_architectures())}"
    )
