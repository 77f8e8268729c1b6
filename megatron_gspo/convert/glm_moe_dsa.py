"""State-dict adapter for GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's maps
(`convert/deepseek_v32.py`), with the indexer weights on the "full" layers of `indexer_types`
only ("shared" layers reuse the previous full layer's top-k and have no indexer, in transformers
and in Megatron-Core's DSAttention alike). The multi-token-prediction layer of the released
checkpoint is not converted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megatron_gspo.convert.param_map import ConversionError
from megatron_gspo.convert.deepseek_v32 import DeepseekV32Adapter, DSADims


@dataclass(frozen=True)
class SharedDSADims(DSADims):
    """DSADims plus the layers that run their own indexer."""

    indexer_layers: tuple[int, ...] = ()


class GlmMoeDsaAdapter(DeepseekV32Adapter):
    """GLM-5: DeepSeek-V3.2 with cross-layer top-k sharing."""

    architectures = ("GlmMoeDsaForCausalLM",)
    model_types = ("glm_moe_dsa",)

    def dims(self, cfg: Mapping) -> SharedDSADims:
        base = super().dims(cfg)
        types = indexer_types(cfg, base.num_layers)
        fields = {k: getattr(base, k) for k in DSADims.__dataclass_fields__}
        return SharedDSADims(**fields, indexer_layers=tuple(
            i for i, t in enumerate(types) if t == "full"))

    def has_indexer(self, i: int, d: SharedDSADims) -> bool:
        return i in d.indexer_layers


def indexer_types(cfg: Mapping, layers: int) -> list[str]:
    """transformers' `GlmMoeDsaConfig.indexer_types` (explicit, from the F/S pattern, or from
    index_topk_freq / index_skip_topk_offset with transformers' defaults 1 / 2)."""
    if cfg.get("indexer_types"):
        types = list(cfg["indexer_types"])
    elif cfg.get("index_topk_pattern") is not None:
        p = cfg["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in p] if isinstance(p, str) \
            else list(p)
    else:
        freq = max(int(cfg.get("index_topk_freq") or 1), 1)
        offset = int(cfg.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(layers)]
    if len(types) != layers or set(types) - {"full", "shared"}:
        raise ConversionError(f"config.json: indexer_types={types!r} must list 'full' / "
                              f"'shared' for each of the {layers} layers")
    return types
