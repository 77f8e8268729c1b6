"""Modules of the local (no Transformer Engine) layer spec that Megatron-Core's own local spec
lacks: an RMSNorm that takes part in sequence parallelism, and core attention over packed
sequences (THD, block-causal: packed sequences never attend to each other). `model.py` puts
them into the spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SequenceParallelRMSNorm(torch.nn.Module):
    """RMSNorm for the local spec whose weight is marked `sequence_parallel` so Megatron
    all-reduces its gradient over TP when sequence parallelism is on (the torch norm of the
    local spec refuses sequence parallelism)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class PackedDotProductAttention(DotProductAttention):
    """Local-spec core attention that accepts packed sequences (THD, `PackedSeqParams`), so
    packed sequences never attend to each other (Megatron-Core's local attention refuses
    `packed_seq_params`).

    Default: segments of equal length are stacked into `[n_l, l]` batches that attend causally
    within themselves: cost sum(l^2) instead of t^2 for a row of t positions, and a sequence's
    numbers do not depend on what else is packed in its row (pipeline padding, neighbours).
    A sliding window (Gemma 3's and gpt-oss's local layers) narrows each segment's causal mask;
    a softmax offset (gpt-oss's attention sinks) joins each softmax row as one more logit.
    Fallback, when attention dropout is active or an attention bias is given: Megatron-Core's
    attention over the whole row with a block-diagonal causal mask.
    """

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs):
        # multi-latent attention passes its query/key and value head dims (Megatron-Core's local
        # attention takes neither): the context is heads * v_channels wide
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, **kwargs)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed qkv_format {packed_seq_params.qkv_format!r} unsupported")
        cu = packed_seq_params.cu_seqlens_q
        dropout = self.attention_dropout.p if self.training else 0.0
        if dropout == 0.0 and attention_bias is None:
            # (sliding windows too: Megatron-Core's torch softmax replaces the given mask by the
            # window mask, which would let packed sequences see each other)
            return self._segment_attention(query, key, value, _segment_plan(cu, query.device),
                                           self.scale_mask_softmax.window_size)
        # [t, np, hn] -> [t, 1, np, hn] (sq, b, np, hn)
        q, k, v = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        mask = _cached_block_causal_mask(cu, q.shape[0], q.device)
        return super().forward(q, k, v, mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, **kwargs)

    def _segment_attention(self, query, key, value, plan, window=None) -> torch.Tensor:
        """Causal attention inside each packed segment.

        Args:
            query, key: [t, np | ng, hn]; value: [t, ng, hv] (ng query groups, np % ng == 0;
                hv may differ from hn, as in multi-latent attention).
            plan: `_segment_plan` output.
            window: (left, right) sliding window or None: key j is seen from query i when
                i - left <= j <= i (right must be 0: causal).
        Returns:
            [t, 1, np * hv] context, like Megatron-Core's DotProductAttention.
        """
        buckets, inverse = plan
        t, heads, dim = query.shape
        groups, vdim = key.shape[1], value.shape[-1]
        half = query.dtype in (torch.float16, torch.bfloat16)  # softmax in fp32 for half inputs
        in_fp32 = half and (self.config.attention_softmax_in_fp32
                            or self.config.apply_query_key_layer_scaling)
        if window is not None and window[1] != 0:
            raise ValueError(f"packed attention: window {window} is not causal (right != 0)")
        # fused causal attention (one kernel, no [n, np, l, l] temporaries, no repeated K/V)
        # where it computes the same softmax: float32, no window, sink or layer scaling
        fused = (query.dtype == torch.float32 and window is None and self.softmax_offset is None
                 and not self.config.apply_query_key_layer_scaling)
        outs = []
        for index, n, length, causal in buckets:
            q = _take(query, index).view(n, length, heads, dim).transpose(1, 2)  # [n, np, l, hn]
            k = _take(key, index).view(n, length, groups, dim).transpose(1, 2)  # [n, ng, l, hn]
            v = _take(value, index).view(n, length, groups, vdim).transpose(1, 2)  # [n, ng, l, hv]
            if fused:
                context = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale,
                    enable_gqa=groups != heads)  # [n, np, l, hv]
                outs.append(context.transpose(1, 2).reshape(n * length, heads * vdim))
                continue
            if window is not None:
                pos = torch.arange(length, device=causal.device)
                causal = causal & (pos[:, None] - pos[None, :] <= window[0])
            if groups != heads:
                k = k.repeat_interleave(heads // groups, dim=1)  # [n, np, l, hn]
                v = v.repeat_interleave(heads // groups, dim=1)
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale  # [n, np, l, l]
            if in_fp32:
                scores = scores.float()
            if self.config.apply_query_key_layer_scaling:
                scores = scores * self.layer_number
            scores = scores.masked_fill(~causal, float("-inf"))
            if self.softmax_offset is not None:  # attention sinks (gpt-oss): one more logit
                sink = self.softmax_offset.to(scores.dtype).view(1, heads, 1, 1)
                scores = torch.cat([scores, sink.expand(n, heads, length, 1)], dim=-1)
                probs = torch.softmax(scores, dim=-1)[..., :-1].to(v.dtype)  # [n, np, l, l]
            else:
                probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [n, np, l, l]
            context = torch.matmul(probs, v)  # [n, np, l, hv]
            outs.append(context.transpose(1, 2).reshape(n * length, heads * vdim))
        context = torch.cat(outs) if len(outs) > 1 else outs[0]  # [t, np*hv], bucket order
        if inverse is not None:  # back to row order (None: the buckets are the row in order)
            context = context.index_select(0, inverse)
        return context.view(t, 1, heads * vdim)


def _as_range(index: torch.Tensor) -> slice:
    """The contiguous positions `index` holds (checked by the caller) as a slice."""
    start = int(index[0])
    return slice(start, start + index.numel())


def _take(x: torch.Tensor, index) -> torch.Tensor:
    """Rows `index` of x: a view for a slice, else `index_select` (its backward is an
    `index_add`, several times cheaper on CPU than the accumulating `index_put` behind
    `x[index]`)."""
    if isinstance(index, slice):
        return x if index.start == 0 and index.stop == x.shape[0] else x[index]
    return x.index_select(0, index)


def _segment_plan(cu_seqlens: torch.Tensor, device):
    """Segments of a packed row grouped by length.

    Args:
        cu_seqlens: [n + 1] segment boundaries (covering the whole row).
        device: where the indices live.
    Returns:
        (buckets, inverse): buckets is a list of (row positions [n_l * l], n_l, l, causal
        [l, l] bool mask, True where key <= query) in increasing l; inverse [t] maps each row
        position to its place in the concatenated bucket outputs. When the buckets already are
        the row in order (one length, or segments sorted by length), inverse is None and the
        positions are slices (views instead of gathers).
    """
    key = (tuple(cu_seqlens.tolist()), str(device))
    if key in _PLAN_CACHE:
        return _PLAN_CACHE[key]
    bounds = cu_seqlens.to(device="cpu", dtype=torch.long).tolist()
    by_length: dict[int, list[int]] = {}
    for b, e in zip(bounds[:-1], bounds[1:], strict=False):
        if e > b:
            by_length.setdefault(e - b, []).append(b)
    buckets, order = [], []
    for length in sorted(by_length):
        starts = torch.tensor(by_length[length])  # [n_l]
        index = (starts[:, None] + torch.arange(length)[None, :]).reshape(-1)  # [n_l * l]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        buckets.append((index.to(device), len(starts), length, causal.to(device)))
        order.append(index)
    order = torch.cat(order)
    if torch.equal(order, torch.arange(order.numel())):  # one length, or sorted by length
        inverse = None
        buckets = [(_as_range(index), n, length, causal) for index, n, length, causal in buckets]
    else:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        inverse = inverse.to(device)
    plan = (buckets, inverse)
    _PLAN_CACHE.clear()  # built once per micro-batch and shared by all layers
    _PLAN_CACHE[key] = plan
    return plan


_PLAN_CACHE: dict = {}

_MASK_CACHE: dict = {}


def _cached_block_causal_mask(cu_seqlens: torch.Tensor, total: int, device) -> torch.Tensor:
    """`block_causal_mask`, built once per micro-batch and shared by all layers."""
    key = (tuple(cu_seqlens.tolist()), total, str(device))
    if key not in _MASK_CACHE:
        _MASK_CACHE.clear()
        _MASK_CACHE[key] = block_causal_mask(cu_seqlens, total, device)
    return _MASK_CACHE[key]


def block_causal_mask(cu_seqlens: torch.Tensor, total: int, device) -> torch.Tensor:
    """[1, 1, t, t] bool mask, True where attention is NOT allowed (other segment or future).

    Args:
        cu_seqlens: [n + 1] segment boundaries covering `total` positions.
        total: t.
        device: where to build it.
    """
    seg = torch.zeros(total, dtype=torch.long, device=device)
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    seg[bounds[1:-1]] = 1
    seg = seg.cumsum(0)  # segment id of each position
    pos = torch.arange(total, device=device)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed).view(1, 1, total, total)
