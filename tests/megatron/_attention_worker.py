"""Packed local-spec attention checks in one process (the CPU layer and Megatron's parallel
state are process-global): prints one JSON line with the largest differences."""

import json

import torch


def main() -> None:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_gspo.megatron import parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_gspo.megatron.models.local_layers import (PackedDotProductAttention,
                                                             block_causal_mask)

    parallel.initialize(parallel.ParallelLayout())
    from megatron.core.packed_seq_params import PackedSeqParams

    torch.manual_seed(0)
    heads, groups, dim = 4, 2, 8
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                            num_query_groups=groups, kv_channels=dim, params_dtype=torch.float64,
                            attention_dropout=0.0, hidden_dropout=0.0)
    attn = PackedDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self").double()

    def packed(lengths, q, k, v):
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        return attn(q, k, v, None, packed_seq_params=psp)  # [t, 1, np*hn]

    lengths = [5, 3, 5, 1, 7, 3, 6]  # repeated lengths share a bucket
    t = sum(lengths)
    q = torch.randn(t, heads, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, groups, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, groups, dim, dtype=torch.float64, requires_grad=True)
    out = packed(lengths, q, k, v)
    w = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad((out * w).sum(), (q, k, v))

    # reference: each sequence alone, plain causal softmax attention in float64
    ref, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].detach() for x in (q, k, v))
        ks = ks.repeat_interleave(heads // groups, dim=1)
        vs = vs.repeat_interleave(heads // groups, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) / dim ** 0.5
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        ref.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs).reshape(n, heads * dim))
        start += n
    ref = torch.cat(ref)

    # Megatron-Core's own attention over the row with the block-diagonal mask (the fallback)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    fb = DotProductAttention.forward(attn, q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1),
                                     block_causal_mask(cu, t, "cpu"))
    fq, fk, fv = torch.autograd.grad((fb * w).sum(), (q, k, v))

    # a sequence's numbers do not depend on what else is packed: add padding and neighbours
    lengths2 = [4, 5, 2, 5, 9]
    t2 = sum(lengths2)
    q2 = torch.randn(t2, heads, dim, dtype=torch.float64)
    k2 = torch.randn(t2, groups, dim, dtype=torch.float64)
    v2 = torch.randn(t2, groups, dim, dtype=torch.float64)
    q2[4:9], k2[4:9], v2[4:9] = q.detach()[:5], k.detach()[:5], v.detach()[:5]
    out2 = packed(lengths2, q2, k2, v2)

    # every way a row's segments can be laid out: one length (the buckets are the row: views),
    # sorted by length (slices), unsorted (gathers); float64 and float32 (the fused kernel)
    def vs_fallback(lens, dtype):
        n = sum(lens)
        xs = [torch.randn(n, h, dim, dtype=dtype, requires_grad=True) for h in (heads, groups,
                                                                                groups)]
        o = packed(lens, *xs)
        g = torch.randn_like(o)
        got = torch.autograd.grad((o * g).sum(), xs)
        c = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        f = DotProductAttention.forward(attn, *(x.unsqueeze(1) for x in xs),
                                        block_causal_mask(c, n, "cpu"))
        want = torch.autograd.grad((f * g).sum(), xs)
        return max([(o - f).abs().max().item()]
                   + [(a - b).abs().max().item() for a, b in zip(got, want, strict=True)])

    layouts = {f"{name}-{str(dt)[6:]}": vs_fallback(lens, dt)
               for name, lens in (("one_length", [6, 6, 6]), ("sorted", [2, 3, 3, 6]),
                                  ("unsorted", [5, 2, 5, 1]))
               for dt in (torch.float64, torch.float32)}

    print("RESULT " + json.dumps({
        "layouts": layouts,
        "vs_reference": (out.detach()[:, 0] - ref).abs().max().item(),
        "vs_fallback": (out - fb).abs().max().item(),
        "grad_vs_fallback": max((a - b).abs().max().item()
                                for a, b in ((gq, fq), (gk, fk), (gv, fv))),
        "invariant": bool(torch.equal(out2[4:9], out.detach()[:5])),
        "shape": list(out.shape),
    }))


if __name__ == "__main__":
    main()
