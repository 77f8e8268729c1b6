"""Packing plan and packed micro-batches for the learner.

A global mini-batch (a list of `Sample`s) is split over data-parallel ranks and, on each rank,
into micro-batches (`plan_microbatches`: every sample lies wholly in one micro-batch, every DP
rank gets the same number of micro-batches, token counts balanced greedily). Each micro-batch is
ONE packed row (`pack_microbatch`): sequences concatenated, positions restarting per sequence,
`cu_seqlens` marking their boundaries so attention never crosses them (THD format).

Alignment: position t of a sequence predicts token t+1, so the response token j (index P+j of
`prompt_ids + response_ids`) is scored at position P+j-1; `targets`, `loss_mask`,
`old_logprobs` and `advantages` live on those predicting positions (0 elsewhere).

Context parallelism: each sequence is padded to a multiple of 2*cp tokens and split into 2*cp
chunks; CP rank r keeps chunks r and 2*cp-1-r (load-balanced causal split, the layout Megatron's
context parallelism expects). `cp_local_index` gives the kept positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_gspo.data.sample import Sample


class BatchError(ValueError):
    """A mini-batch that cannot be planned or packed."""


@dataclass
class MicroBatch:
    """One packed row of S positions holding `num_sequences` sequences (+ trailing padding).

    Tensors (CPU; the learner moves them):
        tokens, position_ids, targets: [1, S] int64.
        loss_mask, old_logprobs, advantages: [1, S] float32 on predicting positions.
        cu_seqlens: [n_seg + 1] int32 segment boundaries (padding segment included).
        seq_index: [n, L] int64 positions of each sequence in the row (padding -> 0).
        seq_valid: [n, L] bool, True on the sequence's own positions.
        seq_advantages: [n] float32 sequence advantages (mean of token advantages for
            per-token advantages).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_index: torch.Tensor
    seq_valid: torch.Tensor
    seq_advantages: torch.Tensor
    sample_indices: list[int] = field(default_factory=list)
    token_advantages: bool = False

    @property
    def num_sequences(self) -> int:
        return len(self.sample_indices)

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-sequence view `[n, L]` of a `[1, S]` / `[S]` row tensor (padding zeroed)."""
        flat = flat.reshape(-1)
        out = flat[self.seq_index.to(flat.device)]  # [n, L]
        return torch.where(self.seq_valid.to(flat.device), out, torch.zeros_like(out))


def _length(s: Sample) -> int:
    return len(s.prompt_ids) + len(s.response_ids)


def plan_microbatches(
    lengths: list[int],
    dp_size: int,
    *,
    num_microbatches: int | None = None,
    max_tokens: int | None = None,
) -> list[list[list[int]]]:
    """Split sample indices over DP ranks, then into micro-batches.

    Args:
        lengths: token count of each sample.
        dp_size: data-parallel ranks.
        num_microbatches: micro-batches per rank (minimum when `max_tokens` is set).
        max_tokens: upper bound on tokens per micro-batch (a longer single sample gets its own).
    Returns:
        plan[dp_rank][micro_batch] = sample indices (same micro-batch count on every rank).
    """
    n = len(lengths)
    if n < dp_size:
        raise BatchError(f"mini-batch of {n} samples cannot feed {dp_size} data-parallel ranks")
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for i in order:  # balance tokens, then sample counts
        r = min(range(dp_size), key=lambda k: (load[k], len(ranks[k]), k))
        ranks[r].append(i)
        load[r] += lengths[i]
    fewest = min(len(r) for r in ranks)
    m = max(1, num_microbatches or 1)
    if max_tokens:
        m = max(m, max(-(-ld // max_tokens) for ld in load))
    if m > fewest:
        if num_microbatches and num_microbatches > fewest:
            raise BatchError(f"{num_microbatches} micro-batches per rank need >= "
                             f"{num_microbatches} samples per rank, a rank has {fewest}")
        m = fewest
    while True:
        plan = [_bins(idx, lengths, m) for idx in ranks]
        too_big = max_tokens and any(
            sum(lengths[i] for i in mb) > max_tokens and len(mb) > 1 for p in plan for mb in p)
        if not too_big or m >= fewest:
            return plan
        m += 1


def _bins(indices: list[int], lengths: list[int], m: int) -> list[list[int]]:
    bins: list[list[int]] = [[] for _ in range(m)]
    load = [0] * m
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        b = min(range(m), key=lambda k: (load[k], len(bins[k]), k))
        bins[b].append(i)
        load[b] += lengths[i]
    return [sorted(b) for b in bins]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pack_microbatch(
    samples: list[Sample],
    sample_indices: list[int],
    *,
    old_logprobs: list[list[float]] | None = None,
    seq_multiple: int = 1,
    total_multiple: int = 1,
    pad_id: int = 0,
) -> MicroBatch:
    """Pack the given samples into one row.

    Args:
        samples: the whole mini-batch.
        sample_indices: which samples (positions in `samples`) go into this micro-batch.
        old_logprobs: per-sample pi_old log-probs of the response tokens (aligned with
            `samples`); None -> each sample's `rollout_logprobs` (zeros if absent, for pure
            forward passes).
        seq_multiple: pad each sequence to a multiple of this (2*cp under context parallel).
        total_multiple: pad the row length to a multiple of this (tp with sequence parallel).
        pad_id: token id used for padding.
    Returns:
        MicroBatch.
    """
    if not sample_indices:
        raise BatchError("empty micro-batch")
    toks, pos, tgt, msk, olp, adv, seg_lens = [], [], [], [], [], [], []
    spans: list[tuple[int, int]] = []
    seq_adv: list[float] = []
    token_adv = False
    start = 0
    for k in sample_indices:
        s = samples[k]
        ids = s.tokens
        p, r = len(s.prompt_ids), len(s.response_ids)
        length = p + r
        padded = _round_up(length, seq_multiple)
        lp = old_logprobs[k] if old_logprobs is not None else s.rollout_logprobs
        if lp is None:
            lp = [0.0] * r
        if len(lp) != r:
            raise BatchError(f"sample {s.index}: {len(lp)} old log-probs for {r} response tokens")
        if s.advantage is None:
            a_tok = [0.0] * r
        elif isinstance(s.advantage, list):
            a_tok, token_adv = [float(a) for a in s.advantage], True
        else:
            a_tok = [float(s.advantage)] * r
        z = [0.0] * (p - 1)
        toks += ids + [pad_id] * (padded - length)
        pos += list(range(padded))
        tgt += ids[1:] + [0] * (padded - length + 1)
        msk += z + [float(m) for m in s.loss_mask] + [0.0] * (padded - length + 1)
        olp += z + [float(x) for x in lp] + [0.0] * (padded - length + 1)
        adv += z + a_tok + [0.0] * (padded - length + 1)
        trainable = [a for a, m in zip(a_tok, s.loss_mask, strict=True) if m]
        seq_adv.append(sum(trainable) / len(trainable) if trainable else 0.0)
        spans.append((start, length))
        seg_lens.append(padded)
        start += padded
    total = _round_up(start, total_multiple)
    if total > start:
        pad = total - start
        toks += [pad_id] * pad
        pos += list(range(pad))
        tgt += [0] * pad
        msk += [0.0] * pad
        olp += [0.0] * pad
        adv += [0.0] * pad
        seg_lens.append(pad)
    cu = [0]
    for n_ in seg_lens:
        cu.append(cu[-1] + n_)
    max_len = max(length for _, length in spans)
    seq_index = torch.zeros(len(spans), max_len, dtype=torch.long)
    seq_valid = torch.zeros(len(spans), max_len, dtype=torch.bool)
    for i, (b, length) in enumerate(spans):
        seq_index[i, :length] = torch.arange(b, b + length)
        seq_valid[i, :length] = True

    def row(x, dt):
        return torch.tensor(x, dtype=dt).reshape(1, -1)

    return MicroBatch(
        tokens=row(toks, torch.long), position_ids=row(pos, torch.long),
        targets=row(tgt, torch.long), loss_mask=row(msk, torch.float32),
        old_logprobs=row(olp, torch.float32), advantages=row(adv, torch.float32),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(seg_lens),
        seq_index=seq_index, seq_valid=seq_valid,
        seq_advantages=torch.tensor(seq_adv, dtype=torch.float32),
        sample_indices=list(sample_indices), token_advantages=token_adv,
    )


def pad_microbatch(mb: MicroBatch, length: int, pad_id: int = 0) -> MicroBatch:
    """Extend a packed row to `length` positions with one trailing padding segment (pipeline
    schedules with fixed tensor shapes need equal lengths).

    Args:
        mb: the micro-batch.
        length: new row length (>= mb.seq_len).
        pad_id: padding token id.
    Returns:
        a new MicroBatch (the same one when no padding is needed).
    """
    extra = length - mb.seq_len
    if extra < 0:
        raise BatchError(f"cannot pad a row of {mb.seq_len} positions to {length}")
    if extra == 0:
        return mb

    def ext(t, value):
        return torch.cat([t, torch.full((1, extra), value, dtype=t.dtype)], dim=1)

    return MicroBatch(
        tokens=ext(mb.tokens, pad_id), position_ids=torch.cat(
            [mb.position_ids, torch.arange(extra, dtype=torch.long)[None]], dim=1),
        targets=ext(mb.targets, 0), loss_mask=ext(mb.loss_mask, 0.0),
        old_logprobs=ext(mb.old_logprobs, 0.0), advantages=ext(mb.advantages, 0.0),
        cu_seqlens=torch.cat([mb.cu_seqlens, torch.tensor([length], dtype=torch.int32)]),
        max_seqlen=max(mb.max_seqlen, extra), seq_index=mb.seq_index, seq_valid=mb.seq_valid,
        seq_advantages=mb.seq_advantages, sample_indices=list(mb.sample_indices),
        token_advantages=mb.token_advantages)


def cp_local_index(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions of a packed row kept by one context-parallel rank.

    Every segment (length a multiple of 2*cp) is cut into 2*cp equal chunks; rank r keeps
    chunks r and 2*cp-1-r, segment after segment.

    Args:
        cu_seqlens: [n_seg + 1] segment boundaries.
        cp_size, cp_rank: context-parallel size and this rank.
    Returns:
        [S / cp] int64 positions, in the order the rank holds them.
    """
    if cp_size == 1:
        return torch.arange(int(cu_seqlens[-1]))
    out = []
    bounds = cu_seqlens.tolist()
    for b, e in zip(bounds[:-1], bounds[1:], strict=False):
        n = e - b
        if n % (2 * cp_size):
            raise BatchError(f"segment of {n} tokens is not a multiple of 2*cp={2 * cp_size}")
        c = n // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.append(torch.arange(b + chunk * c, b + (chunk + 1) * c))
    return torch.cat(out)


def pad_rows(rows: list[list[float]]) -> torch.Tensor:
    """Rows of per-token floats (log-probs, masks, advantages) as one float32 `[B, T]` tensor,
    zero-padded on the right to the longest row (at least one column)."""
    width = max(1, max(len(r) for r in rows))
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out  # [B, T]
