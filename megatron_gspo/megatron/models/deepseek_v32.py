"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 plus DeepSeek Sparse Attention (DSA,
DeepSeek-V3.2-Exp report), on Megatron-Core 0.19's `experimental_attention_variant/dsa.py`.

Every layer's attention is multi-latent attention whose keys are cut, per query, to the
`index_topk` tokens a lightning indexer scores highest: indexer q = wq_b(q latent), k =
LayerNorm(wk(x)), rope on the first `qk_rope_head_dim` channels of both, score(s, t) =
sum_h relu(q_sh . k_t) * softmax_scale * weights_proj(x)_sh * n_heads^-0.5, causal, top-k.

What maps onto what (transformers' `modeling_deepseek_v32.py` vs Megatron-Core 0.19.2):
- attention: `AbsorbedMLASelfAttention` with `DSAttention` core attention and a `DSAIndexer`
  (`models/gpt/experimental_attention_variant_module_specs.py` `get_dsa_module_spec_for_backend`);
  the MLA fields, router, rope and layer pattern are DeepSeek-V3's (`deepseek_v3.config_fields`).
- index_n_heads / index_head_dim / index_topk -> dsa_indexer_n_heads / _head_dim / _topk; the
  indexer's key LayerNorm has eps 1e-6 in transformers (`dsa_indexer_k_norm_epsilon`); its rope
  is half-split, not interleaved (`dsa_indexer_rope_interleaved=False`); relu scoring on. The
  q / kv latent norms keep transformers' eps 1e-6 whatever `rms_norm_eps` is (`LatentRMSNorm`).
- `dsa_indexer_rotate_activation=False`: DeepSeek's reference (and Megatron-Core's default)
  rotates q and k by a Hadamard matrix before an FP8 score; the rotation is orthogonal, so
  the scores are the same, and transformers leaves it out. Megatron-Core's rotation needs the
  CUDA package fast_hadamard_transform and bf16 inputs (`dsa.py` `rotate_activation`).
- `dsa_indexer_loss_coeff=0`: the indexer gets no gradient (transformers runs it under no_grad,
  Megatron-Core detaches its inputs); its KL loss to the attention is a pre-training device.
- `dsa_kernel_backend="none"`: Megatron-Core's PyTorch path (`fused_qk_topk_naive`,
  `_unfused_absorbed_dsa_fn`); the tilelang / cuDNN kernels are the GPU plan
  (docs/model-families.md, "DeepSeek Sparse Attention").

Local spec only (`LOCAL_ONLY`): Megatron-Core builds the DSA layers from a backend with a
`linear()` (duplicated linears), which its `LocalSpecProvider` lacks; `_LocalDSABackend` adds
Megatron-Core's own replicated `Linear` (`post_training/modelopt/layers.py`). Refused in one
line: megatron-core 0.16.1 (`NO_DSA`: its indexer always applies the CUDA-only Hadamard
rotation), tensor parallelism (`parallel.dsa_layout_errors`: not measured
yet; upstream asserts sequence parallelism for `AbsorbedMLASelfAttention`), and DeepSeek-V3's
refusals.
"""

from __future__ import annotations

import importlib.util

from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_gspo.megatron.compat import dsa_torch_path, submodules, version_text
from megatron_gspo.megatron.models import deepseek_v3
from megatron_gspo.megatron.models.deepseek_v3 import DeepseekConfigError

ARCHITECTURE = "DeepseekV32ForCausalLM"
CONFIG_CLASS = MLATransformerConfig
LOCAL_ONLY = ("DeepSeek sparse attention is built on the local spec only (Megatron-Core's DSA "
              "spec takes its linears from a backend; the Transformer Engine one is the GPU plan "
              "in docs/model-families.md)")
NO_DSA = ("{arch} needs megatron-core >= 0.19: the installed {version}'s DSA indexer rotates q "
          "and k by a Hadamard transform unconditionally (transformer/experimental_attention_"
          "variant/dsa.py:591-592 'q = rotate_activation(q)'), which asserts bf16 inputs and the "
          "CUDA package fast_hadamard_transform (dsa.py:41-44); 0.19 makes it optional "
          "(dsa_indexer_rotate_activation)")
ROTATION_LINE = "q = rotate_activation(q)"  # the 0.16.1 line NO_DSA cites


def _require_dsa(arch: str) -> None:
    """Refuse (one line) a megatron-core whose DSA has no PyTorch path for fp32 / CPU."""
    if not dsa_torch_path():
        raise DeepseekConfigError(NO_DSA.format(arch=arch, version=version_text()))


def indexer_fields(cfg: dict, arch: str = ARCHITECTURE) -> dict:
    """TransformerConfig DSA fields from the indexer fields of config.json."""
    _require_dsa(arch)
    fields = {}
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        if not cfg.get(key):
            raise DeepseekConfigError(f"config.json is missing required field {key!r} ({arch})")
        fields[key] = int(cfg[key])
    if fields["index_head_dim"] < int(cfg.get("qk_rope_head_dim") or 0):
        raise DeepseekConfigError(f"config.json index_head_dim={fields['index_head_dim']} < "
                                  f"qk_rope_head_dim={cfg['qk_rope_head_dim']}")
    return dict(
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=fields["index_n_heads"],
        dsa_indexer_head_dim=fields["index_head_dim"],
        dsa_indexer_topk=fields["index_topk"],
        dsa_indexer_loss_coeff=0.0,
        dsa_indexer_rotate_activation=False,
        dsa_indexer_rope_interleaved=False,
        dsa_indexer_scoring_relu=True,
        dsa_indexer_k_norm_epsilon=1e-6,
        dsa_kernel_backend="none",
    )


def config_fields(cfg: dict, use_te: bool) -> dict:
    """MLATransformerConfig fields of DeepSeek-V3.2: DeepSeek-V3's plus the DSA indexer.

    Args:
        cfg: parsed config.json.
        use_te: must be False (`LOCAL_ONLY`).
    Returns:
        dict of fields; raises DeepseekConfigError (one line) for what cannot be expressed.
    """
    if use_te:
        raise DeepseekConfigError(LOCAL_ONLY)
    fields = deepseek_v3.config_fields(cfg, use_te)
    if not fields.get("q_lora_rank"):
        raise DeepseekConfigError("config.json q_lora_rank is required: the DSA indexer's query "
                                  "is projected from the query latent")
    fields.update(indexer_fields(cfg))
    return fields


# The TP refusal lives with the other layout checks (parallel.py, a lower layer).
from megatron_gspo.megatron.parallel import (  # noqa: E402,F401
    DSA_ARCHITECTURES, DSA_NO_TP, dsa_layout_errors)


class _LocalDSABackend:
    """Megatron-Core's `LocalSpecProvider` plus the `linear()` its DSA spec asks for: the
    replicated `Linear` of `post_training/modelopt/layers.py` (parallel_mode 'duplicated')."""

    def __init__(self):
        from megatron.core.models.backends import LocalSpecProvider

        self._local = LocalSpecProvider()

    def __getattr__(self, name):
        return getattr(self._local, name)

    def linear(self):
        from megatron.core.post_training.modelopt.layers import Linear

        return Linear


def bind_absorbed_linear() -> None:
    """0.19.2's `absorbed_mla.py` binds the replicated down-projection class `Linear` only when
    Transformer Engine imports (else None, and its check refuses the local class): bind it."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    if getattr(absorbed_mla, "Linear", None) is None:
        absorbed_mla.Linear = Linear
    if importlib.util.find_spec("transformer_engine") is None:
        absorbed_mla.HAVE_TE = False


LATENT_NORM_EPS = 1e-6


class LatentRMSNorm:
    """RMSNorm of the q / kv latents with transformers' eps: `q_a_layernorm` / `kv_a_layernorm`
    are built with the RMSNorm class default 1e-6, not `rms_norm_eps` (GLM-5: 1e-5), while
    Megatron-Core's MLA gives every norm `layernorm_epsilon`."""

    def __new__(cls, config, hidden_size: int, eps: float = LATENT_NORM_EPS, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=LATENT_NORM_EPS,
                                **kwargs)


def dsa_attention_spec(config):
    """The DSA self-attention spec (AbsorbedMLASelfAttention + DSAttention + DSAIndexer) of
    Megatron-Core, on the local backend, with transformers' latent-norm eps."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )

    bind_absorbed_linear()
    spec = get_dsa_module_spec_for_backend(config=config, backend=_LocalDSABackend())
    attn = submodules(spec)
    attn.q_layernorm = attn.kv_layernorm = LatentRMSNorm
    return spec


def block_spec(config, use_te: bool, vp_stage: int | None, patch_local):
    """DeepSeek-V3's local layer specs with every layer's attention replaced by DSA."""
    if use_te:
        raise DeepseekConfigError(LOCAL_ONLY)
    if config.tensor_model_parallel_size > 1:
        raise DeepseekConfigError(DSA_NO_TP.format(arch="DeepSeek sparse attention"))
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        _validate_dsa_index_share_pipeline_split,
    )
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    start = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    try:  # top-k indices shared across layers do not cross pipeline stages
        _validate_dsa_index_share_pipeline_split(config, range(start, start + count))
    except RuntimeError as e:  # upstream's one-line message
        raise DeepseekConfigError(str(e)) from None
    block = deepseek_v3.block_spec(config, False, vp_stage, patch_local)
    attention = dsa_attention_spec(config)
    for layer in {id(s): s for s in block.layer_specs}.values():
        submodules(layer).self_attention = attention
    return block
