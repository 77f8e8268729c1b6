"""Token log-probs / entropy from tensor-parallel (vocab-sharded) logits, and context-parallel
helpers for per-sequence quantities.

`vocab_parallel_logprobs`: log softmax(logits / T)[target] where each TP rank holds a slice
[V/tp] of the vocabulary. Only [N]-sized max / sum-exp / target-logit vectors cross ranks (three
all-reduces); the full vocabulary is never gathered. Padded vocabulary columns (ids >=
`vocab_size`) are excluded. Computed in float32, in token chunks to bound the working set; the
backward pass recomputes the softmax chunk by chunk: d logp / dz = (onehot - softmax) / T.

Context parallel: each CP rank holds a part of every sequence. The loss is computed replicated
on every CP rank from the whole sequences: `cp_gather` assembles per-token values (forward:
all-gather; backward: each rank keeps the gradient of its own positions, since every rank
computes the same loss), `cp_allreduce_sum` sums per-sequence partial sums the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_CHUNK = 4096
# On the CPU a chunk's float32 temporaries are kept under glibc's largest mmap threshold (32 MiB)
# so that they are reused from the heap instead of faulted in fresh on every call.
CPU_CHUNK_BYTES = 16 << 20


def _chunk_rows(logits: torch.Tensor, chunk: int) -> int:
    if logits.device.type != "cpu":
        return chunk
    return max(1, min(chunk, CPU_CHUNK_BYTES // (4 * max(1, logits.shape[-1]))))


def _mask_padded(z: torch.Tensor, vocab_start: int, vocab_size: int | None) -> torch.Tensor:
    if vocab_size is None or vocab_start + z.shape[-1] <= vocab_size:
        return z
    keep = vocab_size - vocab_start  # may be <= 0 on a rank holding only padding
    z[:, max(keep, 0):] = float("-inf")
    return z


def _stats_chunk(z, t_local, in_range, group):
    """Return (max [C], sumexp [C], target logit [C]) reduced over the TP group."""
    m = z.max(dim=-1).values  # [C]
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    se = (z - m[:, None]).exp().sum(-1)  # [C]
    tz = torch.where(in_range, z.gather(-1, t_local[:, None]).squeeze(-1), torch.zeros_like(m))
    if group is not None:
        dist.all_reduce(se, group=group)
        dist.all_reduce(tz, group=group)
    return m, se, tz


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / T; a new tensor unless the logits are float32 and T is 1 (a view)."""
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


def _chunk_forward(z, t_local, in_range, vocab_start, vocab_size, group, want_entropy):
    """(lse [C], target log-prob [C], entropy [C] or None) of one chunk of scaled logits
    z [C, V_local] (not modified).

    One rank: one fused log-softmax over the real vocabulary columns (padding sliced off),
    and when asked the entropy from the same log-softmax (one exp and a row-wise dot product).
    Several ranks: max / sum-exp / target logit reduced over the group, the entropy's
    sum_v p_v z_v from the same chunk."""
    if group is None:
        if vocab_size is not None and z.shape[-1] > vocab_size:
            z = z[:, :vocab_size]
        lsm = torch.log_softmax(z, -1)  # [C, V]
        lp = lsm.gather(-1, t_local[:, None]).squeeze(-1)
        lse = z.gather(-1, t_local[:, None]).squeeze(-1) - lp
        ent = None
        if want_entropy:  # H = lse - sum_v p_v z_v, p from the log-softmax exponentiated in place
            p = lsm.exp_()
            ent = lse - torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
            bad = ~torch.isfinite(ent)  # -inf logits: 0 * -inf; those rows term by term
            if bool(bad.any()):
                lb = torch.log_softmax(z[bad], -1)
                pl = torch.where(lb > float("-inf"), lb.exp() * lb,
                                 torch.zeros((), device=z.device))
                ent[bad] = -pl.sum(-1)
        return lse, lp, ent
    if vocab_size is not None and vocab_start + z.shape[-1] > vocab_size:
        z = z.clone()  # masked in place below; z may be a view of the logits
    z = _mask_padded(z, vocab_start, vocab_size)
    m, se, tz = _stats_chunk(z, t_local, in_range, group)
    lse = m + se.log()
    ent = None
    if want_entropy:
        p = (z - lse[:, None]).exp()  # [C, V/tp]
        pz = torch.where(p > 0, p * z, torch.zeros_like(p)).sum(-1)  # [C]
        dist.all_reduce(pz, group=group)
        ent = lse - pz
    return lse, tz - lse, ent


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_start, vocab_size, group, chunk,
                want_entropy):
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        out = torch.empty_like(lse)
        ent = torch.empty_like(lse) if want_entropy else None
        t_local = (targets - vocab_start).clamp(0, logits.shape[1] - 1)
        in_range = (targets >= vocab_start) & (targets < vocab_start + logits.shape[1])
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            c_lse, c_lp, c_ent = _chunk_forward(_scaled(logits[s:e], temperature), t_local[s:e],
                                                in_range[s:e], vocab_start, vocab_size, group,
                                                want_entropy)
            lse[s:e], out[s:e] = c_lse, c_lp
            if want_entropy:
                ent[s:e] = c_ent
        ctx.save_for_backward(logits, t_local, in_range, lse)
        ctx.cfg = (temperature, vocab_start, vocab_size, chunk)
        if not want_entropy:
            return out, None
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_ent=None):
        """d logp / dz = (onehot - softmax) g / T, written chunk by chunk into the gradient
        itself (float32 logits: the gradient is the only vocabulary-sized tensor made; other
        dtypes: one float32 chunk more): (z / T - lse) in one pass, then exp, scale and the
        one-hot added in place."""
        logits, t_local, in_range, lse = ctx.saved_tensors
        temperature, vocab_start, vocab_size, chunk = ctx.cfg
        grad = torch.empty_like(logits)
        gt = grad_out.float() / temperature  # [N]
        direct = grad.dtype == torch.float32
        for s in range(0, logits.shape[0], chunk):
            e = min(s + chunk, logits.shape[0])
            d = grad[s:e] if direct else torch.empty((e - s, logits.shape[1]),
                                                     dtype=torch.float32, device=logits.device)
            torch.add(-lse[s:e, None], logits[s:e], alpha=1.0 / temperature, out=d)
            _mask_padded(d, vocab_start, vocab_size).exp_()  # [C, V/tp] softmax slice
            d.mul_(-gt[s:e, None])
            d.scatter_add_(-1, t_local[s:e, None], (gt[s:e] * in_range[s:e].float())[:, None])
            if not direct:
                grad[s:e].copy_(d)
        return grad, None, None, None, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """H = lse - sum_v p_v z_v over the TP-sharded vocabulary; dH/dz_v = -p_v (log p_v + H) / T."""

    @staticmethod
    def forward(ctx, logits, temperature, vocab_start, vocab_size, group, chunk):
        n = logits.shape[0]
        ent = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(ent)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = _mask_padded(logits[s:e].float() / temperature, vocab_start, vocab_size)
            m, se, _ = _stats_chunk(z, torch.zeros(e - s, dtype=torch.long, device=z.device),
                                    torch.zeros(e - s, dtype=torch.bool, device=z.device), group)
            lse[s:e] = m + se.log()
            p = (z - lse[s:e, None]).exp()  # [C, V/tp]
            pz = torch.where(p > 0, p * z, torch.zeros_like(p)).sum(-1)  # [C]
            if group is not None:
                dist.all_reduce(pz, group=group)
            ent[s:e] = lse[s:e] - pz
        ctx.save_for_backward(logits, lse, ent)
        ctx.cfg = (temperature, vocab_start, vocab_size, chunk)
        return ent

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, ent = ctx.saved_tensors
        temperature, vocab_start, vocab_size, chunk = ctx.cfg
        grad = torch.empty_like(logits)
        g = grad_out.float()
        for s in range(0, logits.shape[0], chunk):
            e = min(s + chunk, logits.shape[0])
            z = _mask_padded(logits[s:e].float() / temperature, vocab_start, vocab_size)
            logp = z - lse[s:e, None]  # [C, V/tp]
            p = logp.exp()
            d = torch.where(p > 0, -p * (logp + ent[s:e, None]), torch.zeros_like(p))
            grad[s:e] = (d * (g[s:e, None] / temperature)).to(grad.dtype)
        return grad, None, None, None, None, None


def vocab_parallel_entropy(logits: torch.Tensor, *, temperature: float = 1.0,
                           vocab_start: int = 0, vocab_size: int | None = None, group=None,
                           chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable entropy of softmax(logits / T) over a vocabulary sharded across `group`.

    Args:
        logits: [N, V_local] this rank's vocabulary slice (with grad).
        temperature, vocab_start, vocab_size, group, chunk_size: as in `vocab_parallel_logprobs`.
    Returns:
        [N] float32 entropies (identical on every TP rank).
    """
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return _VocabParallelEntropy.apply(logits, float(temperature), int(vocab_start), vocab_size,
                                       group, _chunk_rows(logits, max(1, int(chunk_size))))


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group=None,
    chunk_size: int = DEFAULT_CHUNK,
    return_entropy: bool = False,
):
    """Log-probs of `targets` under softmax(logits / T) over a vocabulary sharded across `group`.

    Args:
        logits: [..., V_local] this rank's vocabulary slice (any float dtype, with grad).
        targets: [...] global token ids.
        temperature: sampling temperature (> 0).
        vocab_start: global id of this rank's first column.
        vocab_size: true vocabulary size; columns with id >= vocab_size are ignored.
        group: tensor-parallel process group (None or size 1: single rank).
        chunk_size: tokens per chunk.
        return_entropy: also return the (detached) entropy of each token's distribution.
    Returns:
        [...] float32 log-probs, or (log-probs, entropy).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         "disagree")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    lead = targets.shape
    z2 = logits.reshape(-1, logits.shape[-1])  # [N, V_local]
    t1 = targets.reshape(-1).long()  # [N]
    lp, ent = _VocabParallelLogProbs.apply(z2, t1, float(temperature), int(vocab_start),
                                           vocab_size, group,
                                           _chunk_rows(z2, max(1, int(chunk_size))),
                                           bool(return_entropy))
    lp = lp.reshape(lead)
    if not return_entropy:
        return lp
    return lp, ent.reshape(lead)


# ----------------------------------------------------------------------------- context parallel
class _CPAllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        # The loss built from the sum is replicated on every CP rank: each rank's partial sum
        # receives that (identical) gradient once.
        return g, None


def cp_allreduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the CP group; backward passes the gradient through unchanged.

    Args:
        x: any tensor (e.g. [n] per-sequence partial sums of this rank's tokens).
        group: context-parallel process group (None / size 1: identity).
    Returns:
        the sum over CP ranks, same shape.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _CPAllReduceSum.apply(x, group)


class _CPGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, total, group):
        size = dist.get_world_size(group)
        xs = [torch.empty_like(x) for _ in range(size)]
        idx = [torch.empty_like(index) for _ in range(size)]
        dist.all_gather(xs, x.contiguous(), group=group)
        dist.all_gather(idx, index.contiguous(), group=group)
        out = x.new_zeros(total)
        out[torch.cat(idx)] = torch.cat(xs)
        ctx.save_for_backward(index)
        return out

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        return g[index], None, None, None


def cp_gather(x: torch.Tensor, index: torch.Tensor, total: int, group) -> torch.Tensor:
    """Assemble a full packed row from every CP rank's positions.

    Args:
        x: [S_local] this rank's values (e.g. token log-probs, with grad).
        index: [S_local] int64 global positions of those values (`cp_local_index`).
        total: S, the full row length.
        group: context-parallel process group (None / size 1: scatter into place).
    Returns:
        [S] values in global order; gradient flows back to this rank's positions only.
    """
    if group is None or dist.get_world_size(group) == 1:
        if x.shape[0] == total and torch.equal(index, torch.arange(total, device=index.device)):
            return x  # one rank holding every position in order
        out = x.new_zeros(total)
        return out.index_put((index,), x)
    return _CPGather.apply(x, index, total, group)


def sequence_sums(values: torch.Tensor, seq_index: torch.Tensor, seq_valid: torch.Tensor,
                  group=None) -> torch.Tensor:
    """Per-sequence sums of per-position values, summed over CP ranks.

    Args:
        values: [S] per-position values (positions a rank does not hold are 0).
        seq_index / seq_valid: [n, L] positions of each sequence (MicroBatch fields).
        group: CP group for the cross-rank sum (None: local only).
    Returns:
        [n] sums.
    """
    rows = torch.where(seq_valid, values[seq_index], torch.zeros((), dtype=values.dtype,
                                                                 device=values.device))
    return cp_allreduce_sum(rows.sum(-1), group)
