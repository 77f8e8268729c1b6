"""One line instead of Megatron-Core's import-time warnings about missing CUDA extensions.

Without Transformer Engine and apex (any CPU run, and GPU installs without them) Megatron-Core
warns once per module while being imported (megatron/core/optimizer/__init__.py, optimizer.py,
clip_grads.py, distributed/fsdp/.../mixed_precision.py, models/backends.py,
models/gpt/gpt_layer_specs.py), and its TransformerConfig warns that its own default
cuda-graph scope "full" is deprecated (these and 0.19's notices: `compat.QUIET_WARNINGS`,
`compat.quiet_logs`). `quiet_fallback_warnings` (run when this package is imported, before any
megatron.core import in this code) silences exactly those messages;
`fallback_summary` reads which fallbacks Megatron-Core actually chose from the imported modules,
for the run log. Imports nothing heavy.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings

from megatron_gspo.megatron.compat import QUIET_WARNINGS, quiet_logs

def te_available() -> bool:
    """True when Transformer Engine is importable (never imports it)."""
    return importlib.util.find_spec("transformer_engine") is not None


# Messages Megatron-Core 0.13-0.19 emits at import time when TE / apex are missing (regexes
# matched at the start of the message), plus the notices of `compat.QUIET_WARNINGS`.
QUIET = (
    r"Transformer Engine and Apex are not installed\. Falling back to",
    r"Apex is not installed\. Falling back to Torch Norm",
    *QUIET_WARNINGS,
)


# FutureWarnings of every checkpoint load that no user can act on: Megatron-Core 0.16's
# torch_dist strategy calls torch's deprecated `checkpoint.load_state_dict`, and its
# ShardedTensor-based state dicts make torch warn about ShardedTensor (raised from inside
# torch's dispatch, so matched by message only, and only this exact deprecation notice).
QUIET_FUTURE = (
    (r"`load_state_dict` is deprecated and will be removed in future versions\. Please use "
     r"`load` instead", r"megatron\.core\.dist_checkpointing"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", ""),
)


def quiet_fallback_warnings() -> None:
    """Ignore the `QUIET` messages from Megatron modules and the `QUIET_FUTURE` deprecation
    notices of checkpoint loads (idempotent; other warnings, and these messages from anywhere
    else, are untouched)."""
    for msg in QUIET:
        warnings.filterwarnings("ignore", message=msg, category=UserWarning, module=r"megatron")
    for msg, module in QUIET_FUTURE:
        warnings.filterwarnings("ignore", message=msg, category=FutureWarning, module=module)
    quiet_logs()  # compat: 0.19's log notices (GPTModel deprecation, sync-save notice)


def bind_missing_te_names() -> None:
    """Bind the Transformer Engine names Megatron-Core reads without TE installed.

    megatron-core 0.16.1's `transformer/moe/moe_utils.py` binds `te_general_gemm` only inside
    its TE import, and the MoE router's gating GEMM reads it on every call (`is not None`
    selects the torch path): without TE, on any device, the first MoE forward raised NameError.
    Its `transformer/multi_latent_attention.py` sets `HAVE_TE = True` whenever
    `megatron.core.extensions.transformer_engine` imports, which it does without TE (binding
    `TELinear` to a MagicMock attribute): every MLA layer then raised TypeError in
    `isinstance(self.linear_proj, TELinear)`. Without TE installed, `HAVE_TE` is set False there.
    0.19.2's MLA binds its replicated down-projection class `Linear`
    (`post_training/modelopt/layers.py`, the one its `linear_kv_down_proj` check accepts besides
    the column-parallel ones) only when TE imports; it is bound here when missing (0.16.1 binds it
    without TE), so the local spec can build the down projections replicated, as the TE spec does.
    Idempotent; run by `megatron_gspo.megatron.models.builder` at import, before any model is built.
    """
    import importlib.util

    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
    if getattr(multi_latent_attention, "Linear", None) is None:
        from megatron.core.post_training.modelopt.layers import Linear

        multi_latent_attention.Linear = Linear


def _attr(module: str, name: str, default=None):
    mod = sys.modules.get(module)
    return getattr(mod, name, default) if mod is not None else default


def fallback_summary() -> str | None:
    """What Megatron-Core falls back to in this process, from the modules already imported.

    Returns:
        "Megatron-Core fallbacks (no Transformer Engine, no apex): ..." naming each fallback in
        use, or None when there is none (or Megatron-Core is not imported).
    """
    specs = "megatron.core.models.gpt.gpt_layer_specs"
    found = []
    if _attr("megatron.core.optimizer", "USING_PYTORCH_OPTIMIZER", False):
        found.append("torch optimizers (AdamW / SGD) instead of fused Adam / SGD")
    applier = _attr("megatron.core.optimizer.clip_grads", "multi_tensor_applier")
    if getattr(applier, "__name__", "").startswith("local_"):
        found.append("local multi-tensor ops (grad norm, scaling)")
    if _attr(specs, "HAVE_APEX", True) is False:
        found.append("torch norms in the local layer spec")
    if _attr(specs, "HAVE_TE", True) is False:
        found.append("local layer spec (no TE layers)")
    if not found:
        return None
    missing = [name for name, have in (("Transformer Engine", _attr(specs, "HAVE_TE", True)),
                                       ("apex", _attr(specs, "HAVE_APEX", True))) if not have]
    head = "Megatron-Core fallbacks" + (f" (no {', no '.join(missing)})" if missing else "")
    return f"{head}: " + "; ".join(found)
