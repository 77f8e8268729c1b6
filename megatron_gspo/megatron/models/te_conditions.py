"""Conditions Megatron-Core 0.16.1 asserts only while it builds Transformer Engine modules, so
only on a GPU with TE, checked here on the TransformerConfig alone: a CPU build of the config
with `use_te=True` (tests, `build_model_config`) sees them before a GPU run crashes on them.
Each entry names the upstream file and the condition it mirrors."""

from __future__ import annotations


def te_build_problems(config) -> list[str]:
    """What the TE spec of `config` would refuse at model build (empty: nothing).

    Args:
        config: a TransformerConfig meant for the Transformer Engine layer spec.
    Returns:
        one line per refused setting, naming the fields.
    """
    out = []
    # megatron/core/transformer/moe/experts.py, TEGroupedMLP.__init__ (the TE spec's experts
    # with moe_grouped_gemm): assert not (self.config.add_bias_linear and
    # config.bias_dropout_fusion)
    if (config.num_moe_experts and config.moe_grouped_gemm and config.add_bias_linear
            and config.bias_dropout_fusion):
        out.append("bias_dropout_fusion=True with add_bias_linear=True is refused by "
                   "Megatron-Core's TEGroupedMLP (grouped-GEMM experts of the TE spec)")
    return out
