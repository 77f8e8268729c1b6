"""Qwen3.5 text models in Megatron-Core 0.16.1 / 0.19.2: dense (Qwen3_5ForCausalLM) and MoE
(Qwen3_5MoeForCausalLM); HF config -> TransformerConfig fields and the local layer spec.

The layers are Qwen3-Next's (`megatron.models.qwen3_next`, transformers'
`modular_qwen3_5.py` subclasses `modeling_qwen3_next.py`): Gated DeltaNet (arXiv 2412.06464)
and gated full-attention layers in the `layer_types` pattern, zero-centred norms, partial
rotary. The delta-net's weights differ only in their HF spelling (`convert.qwen3_5`); the
module, Megatron-Core's GatedDeltaNet, is the same. What this module changes:
- dense: no experts, a SwiGLU MLP on every layer (`intermediate_size`);
- MoE: experts on every layer, top-k weights always renormalised (transformers'
  `Qwen3VLMoeTextTopKRouter`; Qwen3.5-MoE configs carry no `norm_topk_prob`);
- rotary: MRoPE with text-only positions (the three position rows equal) is 1-D rotary over
  the first `partial_rotary_factor` of each head, which is what GPTModel builds (whatever
  `mrope_section` says: it only picks which position row feeds each frequency).
Refused as for Qwen3-Next: the Transformer Engine spec, TP without SP, context parallelism;
and the vision-language configs (`convert.qwen3_5.REFUSAL`).
"""

from __future__ import annotations

from megatron.core.transformer import TransformerConfig

from megatron_gspo.convert.qwen3_5 import REFUSAL, TEXT_OF
from megatron_gspo.megatron.models import qwen3_next

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
ARCHITECTURE = ARCHITECTURES[0]
# configs the builder refuses with this one-line reason (the released vision-language ones)
REFUSED = {arch: REFUSAL.format(arch=arch) for arch in TEXT_OF}
CONFIG_CLASS = TransformerConfig
LOCAL_ONLY = ("Qwen3.5's Transformer Engine spec (Megatron-Core's experimental block spec) is "
              "not checked here (no GPU); it uses the local spec")


class Qwen3_5ConfigError(ValueError):
    """A Qwen3.5 config field this build cannot express."""


def _renamed(e: Exception, arch: str) -> Qwen3_5ConfigError:
    """Qwen3-Next's one-line error, naming this architecture."""
    msg = str(e).replace(qwen3_next.ARCHITECTURE, arch).replace("Qwen3-Next", "Qwen3.5")
    return Qwen3_5ConfigError(msg.replace(qwen3_next.LOCAL_ONLY, LOCAL_ONLY))


def config_fields(cfg: dict, use_te: bool) -> dict:
    """TransformerConfig fields of Qwen3.5 dense / MoE on top of the dense defaults."""
    arch = (cfg.get("architectures") or [ARCHITECTURE])[0]
    if arch in TEXT_OF:
        raise Qwen3_5ConfigError(REFUSAL.format(arch=arch))
    moe = bool(cfg.get("num_experts"))
    if moe != (arch == "Qwen3_5MoeForCausalLM"):
        raise Qwen3_5ConfigError(f"config.json of {arch} " + (
            "sets num_experts (Qwen3_5MoeForCausalLM has experts)" if moe else
            "lacks an integer num_experts (needed by its layers)"))
    for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
        if moe and key in cfg and cfg[key] not in (1, [], True, None):
            raise Qwen3_5ConfigError(f"config.json {key}={cfg[key]!r} is not a Qwen3.5-MoE "
                                     "field (every layer is MoE, top-k renormalised)")
    try:
        out = qwen3_next.config_fields(cfg, use_te)
    except qwen3_next.Qwen3NextConfigError as e:
        raise _renamed(e, arch) from None
    if moe:
        out["moe_router_pre_softmax"] = False  # softmax, top-k, renormalise (always)
    return out


def block_spec(config, use_te: bool, vp_stage: int | None, patch_local):
    """Per-layer local specs of this pipeline stage (Qwen3-Next's; `use_te` must be False)."""
    try:
        return qwen3_next.block_spec(config, use_te, vp_stage, patch_local)
    except qwen3_next.Qwen3NextConfigError as e:
        raise _renamed(e, ARCHITECTURE) from None


def gpt_model_kwargs(cfg: dict) -> dict:
    """GPTModel rotary arguments: base and the rotated share of each head."""
    return qwen3_next.gpt_model_kwargs(cfg)


def post_build(model, cfg: dict) -> None:
    """The delta-net's TP partition dims (as for Qwen3-Next)."""
    qwen3_next.post_build(model, cfg)
