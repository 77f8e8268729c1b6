"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's multi-latent attention with DeepSeek Sparse
Attention (`deepseek_v32.py`), with two differences in transformers' `modeling_glm_moe_dsa.py`:

- the indexer's rope is interleaved (`apply_rotary_pos_emb_interleave`) ->
  `dsa_indexer_rope_interleaved=True` (Megatron-Core's MLA-style de-interleave, then rotate half:
  the same numbers);
- cross-layer top-k sharing (`indexer_types`: "full" layers run their indexer, "shared" ones reuse
  the previous full layer's top-k and carry no indexer weights) -> Megatron-Core's
  `dsa_indexer_topk_freq` / `dsa_indexer_skip_topk_offset` (`dsa.py` `is_dsa_skip_topk_layer`).
  The pair is the one whose pattern equals `indexer_types`; a pattern no pair gives is refused.

Refused in one line besides DeepSeek-V3.2's refusals: `indexer_rope_interleave=false` (transformers'
GLM-5 indexer always interleaves), an `indexer_types` list Megatron-Core cannot express, and a
pipeline split that puts a shared layer first on a stage (upstream's
`_validate_dsa_index_share_pipeline_split`: top-k indices do not cross pipeline stages).
"""

from __future__ import annotations

from megatron_gspo.convert.glm_moe_dsa import indexer_types
from megatron_gspo.megatron.models import deepseek_v32
from megatron_gspo.megatron.models.deepseek_v3 import DeepseekConfigError
from megatron_gspo.megatron.models.deepseek_v32 import (  # noqa: F401
    CONFIG_CLASS,
    LOCAL_ONLY,
    block_spec,
)

ARCHITECTURE = "GlmMoeDsaForCausalLM"


def indexer_pattern(layers: int, freq: int, offset: int) -> list[str]:
    """Megatron-Core's per-layer indexer kinds ("full" / "shared") for (freq, offset)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        is_dsa_skip_topk_layer,
    )

    return ["shared" if is_dsa_skip_topk_layer(i + 1, offset, freq) else "full"
            for i in range(layers)]


def sharing_fields(cfg: dict) -> dict:
    """dsa_indexer_topk_freq / dsa_indexer_skip_topk_offset giving transformers' indexer_types."""
    layers = int(cfg["num_hidden_layers"])
    want = indexer_types(cfg, layers)
    if all(t == "full" for t in want):
        return dict(dsa_indexer_topk_freq=1, dsa_indexer_skip_topk_offset=0)
    for freq in range(2, layers + 1):
        for offset in range(1, layers + 1):
            if indexer_pattern(layers, freq, offset) == want:
                return dict(dsa_indexer_topk_freq=freq, dsa_indexer_skip_topk_offset=offset)
    raise DeepseekConfigError(
        f"config.json indexer_types={want!r} is not a pattern Megatron-Core's DSA top-k sharing "
        "can express (a full layer every dsa_indexer_topk_freq layers after "
        "dsa_indexer_skip_topk_offset)")


def config_fields(cfg: dict, use_te: bool) -> dict:
    """MLATransformerConfig fields of GLM-5: DeepSeek-V3.2's, interleaved indexer rope, top-k
    sharing. Raises DeepseekConfigError (one line) for what cannot be expressed."""
    if cfg.get("indexer_rope_interleave") is False:
        raise DeepseekConfigError("config.json indexer_rope_interleave=false is not supported for "
                                  f"{ARCHITECTURE} (transformers' indexer always interleaves)")
    fields = deepseek_v32.config_fields(cfg, use_te)
    fields.update(dsa_indexer_rope_interleaved=True, **sharing_fields(cfg))
    return fields
