"""One batch of rows the embedded engine decodes together (`rollout.embedded`): the left-padded
prompts, each row's sampling settings as tensors, its stop ids, budget and random stream, and the
sampling distribution both decoders (plain, `embedded_speculative`) draw from: softmax of the
temperature-scaled logits after top-k / top-p filtering; returned log-probs are the full-vocab
log_softmax(logits / T) (`rollout.engine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_gspo.rollout.engine import RolloutError, SamplingParams


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p set with -inf.

    Args:
        logits: [B, V] temperature-scaled logits.
        top_k: [B] int, <= 0 means off.
        top_p: [B] float in (0, 1].
    Returns:
        [B, V] masked logits (the most likely token always survives).
    """
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)  # [B, 1]
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [B, V] mass of strictly better tokens
    drop |= mass_before >= top_p.unsqueeze(-1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


@dataclass
class DecodeRows:
    """Tensors and settings of one decode batch (`prepare_rows`)."""

    ids: torch.Tensor  # [B, P] left-padded prompts
    mask: torch.Tensor  # [B, P] 1 = real token
    temps: torch.Tensor  # [B] (1 for greedy rows)
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    need_filter: bool
    stops: list[set[int]]
    budget: list[int]  # most new tokens per row
    row_gens: list  # per-row torch.Generator (a seeded request) or None

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def distributions(self, logits: torch.Tensor, version: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [B, ..., V] -> (scaled, full-vocab log-probs, sampling probs), each like it.

        Raises:
            RolloutError: non-finite probabilities (an overflowed weight update).
        """
        shape = logits.shape
        b = shape[0]
        flat = logits.float().reshape(b, -1, shape[-1])  # [B, S, V]
        scaled = flat / self.temps.view(b, 1, 1)
        logp = torch.log_softmax(scaled, dim=-1)
        cand = scaled
        if self.need_filter:
            s = scaled.shape[1]
            cand = filter_logits(scaled.reshape(b * s, -1), self.top_k.repeat_interleave(s),
                                 self.top_p.repeat_interleave(s)).reshape_as(scaled)
        probs = torch.softmax(cand, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            raise RolloutError(
                f"embedded engine: the policy's next-token probabilities are not finite at "
                f"weight version {version}: the weights of the optimizer update that made "
                f"version {version} overflow (logits inf/nan); lower optimizer.lr or check the "
                "gradients")
        return scaled.reshape(shape), logp.reshape(shape), probs.reshape(shape)


def prepare_rows(rows: Sequence[tuple[Sequence[int], SamplingParams]], device: torch.device,
                 eos_token_ids: Sequence[int], max_model_len: int) -> DecodeRows:
    """Left-pad the prompts and gather each row's sampling settings.

    Raises:
        ValueError: a prompt that leaves no room under `max_model_len` (names the row).
    """
    lens = [len(p) for p, _ in rows]
    for i, n in enumerate(lens):
        if n >= max_model_len:
            raise ValueError(f"prompt of {n} tokens (row {i}) leaves no room under "
                             f"max_model_len {max_model_len}")
    bsz, width = len(rows), max(lens)
    ids = torch.zeros(bsz, width, dtype=torch.long, device=device)  # [B, P] left-padded
    mask = torch.zeros(bsz, width, dtype=torch.long, device=device)  # [B, P]
    for i, (p, _) in enumerate(rows):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    sps = [sp for _, sp in rows]
    # a row with its own seed draws from its own stream: what it samples does not depend on
    # the rows it shares the batch with (SGLang's per-request `sampling_seed`)
    return DecodeRows(
        ids=ids, mask=mask,
        temps=torch.tensor([1.0 if sp.greedy else sp.temperature for sp in sps], device=device),
        greedy=torch.tensor([sp.greedy for sp in sps], device=device),
        top_k=torch.tensor([sp.top_k for sp in sps], device=device),
        top_p=torch.tensor([sp.top_p for sp in sps], device=device),
        need_filter=any(sp.top_k > 0 or sp.top_p < 1.0 for sp in sps),
        stops=[set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
               for sp in sps],
        budget=[min(sp.max_new_tokens, max_model_len - n) for sp, n in zip(sps, lens,
                                                                          strict=True)],
        row_gens=[None if sp.seed is None else torch.Generator(device=device).manual_seed(sp.seed)
                  for sp in sps],
    )


def draw(probs: torch.Tensor, row_gens: list, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [B, V]: rows with their own generator from it, the others
    from `generator` (one batched draw when no row has a seed)."""
    if all(g is None for g in row_gens):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [B]
    return torch.cat([torch.multinomial(probs[i:i + 1], 1,
                                        generator=g if g is not None else generator)
                      for i, g in enumerate(row_gens)]).squeeze(-1)  # [B]


def uniforms(shape: tuple[int, int], row_gens: list, generator: torch.Generator,
             device: torch.device) -> torch.Tensor:
    """[B, K] uniforms in [0, 1), each row's from its own generator where it has one."""
    if all(g is None for g in row_gens):
        return torch.rand(shape, generator=generator, device=device)
    return torch.stack([torch.rand(shape[1:], generator=g if g is not None else generator,
                                   device=device) for g in row_gens])
