"""Local-spec modules for Gemma 3 that Megatron-Core 0.16.1's TransformerLayer lacks.

- `GemmaRMSNorm`: RMSNorm scaled by (1 + weight), computed in float32 and cast back, the way
  transformers' Gemma3RMSNorm does; the weight keeps the checkpoint's values (no +1 folded in,
  so HF -> Megatron -> HF stays bit-exact).
- `PostNormRowParallelLinear`: a RowParallelLinear followed by a GemmaRMSNorm of its (reduced)
  output: Gemma 3's sandwich norms (`post_attention_layernorm` after `o_proj`,
  `post_feedforward_layernorm` after `down_proj`), applied before the residual add as in
  transformers. TransformerLayer has no module slot after attention / MLP, so the norm lives
  in the output projection (`linear_proj.post_norm`, `linear_fc2.post_norm`).
- `DualRopeSelfAttention`: SelfAttention whose sliding-window layers rotate with their own
  rotary base (`rope_parameters.sliding_attention.rope_theta`, 10k) instead of the model's
  (global layers: 1M, optionally linear-scaled): GPTModel builds one rotary table for all layers.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.utils import is_layer_window_attention


class GemmaRMSNorm(torch.nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), in float32, cast to the input dtype.

    The weight is marked `sequence_parallel` (gradient all-reduced over TP under SP)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class PostNormRowParallelLinear(RowParallelLinear):
    """RowParallelLinear + GemmaRMSNorm on its output (after the TP reduction)."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        if config.add_bias_linear:
            raise ValueError("PostNormRowParallelLinear supports bias-free layers only")
        self.post_norm = GemmaRMSNorm(config, output_size, eps=config.layernorm_epsilon)

    def forward(self, input_):
        out, bias = super().forward(input_)
        return self.post_norm(out), bias


class DualRopeSelfAttention(SelfAttention):
    """SelfAttention; on sliding-window layers the rotary table of `config.local_rotary_base`
    replaces the model's (same length, so packed and padded inputs work alike)."""

    def __init__(self, config, submodules, layer_number: int, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.local_rope = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     self.layer_number):
            self.local_rope = RotaryEmbedding(
                kv_channels=config.kv_channels, rotary_percent=1.0,
                rotary_base=config.local_rotary_base, use_cpu_initialization=True)

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if self.local_rope is not None and rotary_pos_emb is not None:
            table = self.local_rope(rotary_pos_emb.shape[0])  # [S, 1, 1, d]
            rotary_pos_emb = table.to(rotary_pos_emb.device)
        return super().forward(hidden_states, attention_mask, *args,
                               rotary_pos_emb=rotary_pos_emb, **kwargs)


def scale_embeddings(model: torch.nn.Module, hidden_size: int) -> None:
    """Multiply the embedding output by sqrt(hidden_size) in the embedding's dtype (transformers'
    Gemma3TextScaledWordEmbedding); the output layer (tied) sees the unscaled weight."""
    emb = getattr(model, "embedding", None)
    if emb is None:
        return
    scale = torch.tensor(hidden_size ** 0.5)

    def hook(_module, _args, out):
        return out * scale.to(device=out.device, dtype=out.dtype)

    emb.register_forward_hook(hook)
