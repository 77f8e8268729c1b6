"""Speculative decoding of one batch in the embedded engine: the model's MTP head
(`rollout.mtp_draft`) drafts a chain of K tokens per row, the target verifies all of them in one
forward, and `algo.speculative_sampling.verify_chain` accepts a prefix exactly (speculative
sampling, Leviathan et al. arXiv 2211.17192 / Chen et al. arXiv 2302.01318).

Layout: every verification appends K+1 slots to each row's KV cache (the pending token and the K
drafts); the slots past a row's accepted prefix stay in the cache as holes, masked out of every
later attention (attention mask 0), and positions are the rows' true positions (`position_ids`),
so each row advances by its own accepted count while the batch keeps one cache length. The
draft layer has its own cache with the same slots: its entry at position i holds
[Emb(t_{i+1}); h_i] of the verified sequence (the teacher-forced input the learner trains it
on); the chain's speculative entries (steps 2..K) are dropped after each chain.

Exactness: a row's tokens are those of standard speculative sampling on that row alone (the
other rows share only the batch, not the randomness: one generator's independent draws, or the
row's own seeded generator); masked slots contribute nothing to attention, so the target's
distributions are the row's own up to floating-point summation order. Stop ids and the token
budget end a row after the emitted token that meets them, as in plain decoding; nothing past
them is emitted. Returned log-probs are the target's full-vocab log_softmax(logits / T) at each
emitted token's position, the same quantity plain decoding returns.
"""

from __future__ import annotations

import torch

from megatron_gspo.algo.speculative_sampling import emitted_logprobs, verify_chain
from megatron_gspo.rollout.embedded_batch import DecodeRows, draw, uniforms


def _drop_last(cache, n: int) -> None:
    """Remove the last `n` slots of every layer of a transformers cache."""
    if n > 0:
        cache.crop(-n)


class _Hidden:
    """Forward hook on the decoder stack: its last output's last_hidden_state (final-normed)."""

    def __init__(self, base: torch.nn.Module) -> None:
        self.h = None
        self._handle = base.register_forward_hook(self._keep)

    def _keep(self, module, args, out) -> None:
        self.h = out[0] if isinstance(out, tuple) else out.last_hidden_state

    def close(self) -> None:
        self._handle.remove()


@torch.no_grad()
def speculative_decode(model, draft, batch: DecodeRows, steps: int, cache_kw: str,
                       generator: torch.Generator, version: int, max_model_len: int,
                       ) -> tuple[list[tuple], dict]:
    """Decode `batch` with K = `steps` draft tokens per verification.

    Args:
        model: the target causal LM (transformers).
        draft: its `MTPDraft`.
        batch: the rows (`embedded_batch.prepare_rows`).
        steps: draft tokens per chain (>= 1).
        cache_kw: the model forward's cache keyword ("cache" or "past_key_values").
        generator: the engine's random stream (rows without their own seed).
        version: weight version (for the non-finite error).
        max_model_len: positions beyond it are clamped (they only feed slots never emitted).
    Returns:
        (response ids, log-probs, finish reason) per row, and counts: `verify_steps`,
        `row_verifies` (active rows summed over them), `drafted` / `accepted` (draft tokens of
        active rows), `emitted` (tokens emitted by verifications).
    """
    from transformers import DynamicCache

    K, B, dev = int(steps), batch.size, batch.ids.device
    rows = torch.arange(B, device=dev)
    cache, dcache = DynamicCache(), DynamicCache()
    grab = _Hidden(model.model)
    mask = batch.mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
    out_ids: list[list[int]] = [[] for _ in range(B)]
    out_lps: list[list[float]] = [[] for _ in range(B)]
    reasons, done = ["length"] * B, [False] * B
    stats = {"verify_steps": 0, "row_verifies": 0, "drafted": 0, "accepted": 0, "emitted": 0}

    def emit(i: int, toks: list[int], lps: list[float]) -> None:
        for t, lp in zip(toks, lps, strict=True):
            out_ids[i].append(t)
            out_lps[i].append(lp)
            if t in batch.stops[i]:
                done[i], reasons[i] = True, "stop"
                return
            if len(out_ids[i]) >= batch.budget[i]:
                done[i] = True
                return

    def pick(probs, scaled):  # [B, V] -> [B]: the rows' sampler, argmax for greedy rows
        return torch.where(batch.greedy, scaled.argmax(-1), draw(probs, batch.row_gens,
                                                                 generator))

    try:
        kw = {cache_kw: cache, "use_cache": True}
        logits = model(input_ids=batch.ids, attention_mask=mask, position_ids=pos,
                       logits_to_keep=1, **kw).logits[:, -1]  # [B, V]
        hid = grab.h  # [B, P, H]
        scaled, logp, probs = batch.distributions(logits, version)
        tok = pick(probs, scaled)  # [B] the first response token
        lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        for i in range(B):
            emit(i, [int(tok[i])], [float(lp[i])])
        # the draft over the prompt: position i sees [Emb(t_{i+1}); h_i]
        nxt = torch.cat([batch.ids[:, 1:], tok[:, None]], dim=-1)  # [B, P]
        o = draft(nxt, hid, pos, mask, dcache)[:, -1]  # [B, H]
        at = pos[:, -1] + 1  # [B] position of the pending token `tok`
        while not all(done):
            # ---- draft a chain of K tokens
            d_tok, d_probs = [], []
            dmask = mask
            for j in range(K):
                if j:
                    dmask = torch.cat([dmask, torch.ones_like(mask[:, :1])], dim=-1)
                    p_j = (at + j - 1).clamp(max=max_model_len - 1)[:, None]  # [B, 1]
                    o = draft(d_tok[-1][:, None], o[:, None], p_j, dmask, dcache)[:, 0]
                sc, _, pr = batch.distributions(draft.logits(o), version)  # [B, V]
                d_tok.append(pick(pr, sc))
                d_probs.append(pr)
            _drop_last(dcache, K - 1)
            chain = torch.stack(d_tok, 1)  # [B, K]
            # ---- verify: the pending token and the K drafts in one target forward
            vpos = (at[:, None] + torch.arange(K + 1, device=dev)).clamp(max=max_model_len - 1)
            vmask = torch.cat([mask, torch.ones(B, K + 1, dtype=mask.dtype, device=dev)], -1)
            inp = torch.cat([tok[:, None], chain], dim=-1)  # [B, K+1]
            logits = model(input_ids=inp, attention_mask=vmask, position_ids=vpos,
                           **kw).logits  # [B, K+1, V]
            hid = grab.h  # [B, K+1, H]
            scaled, logp, probs = batch.distributions(logits, version)
            u = uniforms((B, K), batch.row_gens, generator, dev)
            acc, toks = verify_chain(probs, torch.stack(d_probs, 1), chain, u,
                                     lambda p: draw(p, batch.row_gens, generator),
                                     greedy=batch.greedy, target_argmax=scaled.argmax(-1))
            lps = emitted_logprobs(logp, toks)  # [B, K+1]
            acc_l, toks_l, lps_l = acc.tolist(), toks.tolist(), lps.tolist()
            stats["verify_steps"] += 1
            for i in range(B):
                if done[i]:
                    continue
                stats["row_verifies"] += 1
                stats["drafted"] += K
                stats["accepted"] += acc_l[i]
                before = len(out_ids[i])
                emit(i, toks_l[i][:acc_l[i] + 1], lps_l[i][:acc_l[i] + 1])
                stats["emitted"] += len(out_ids[i]) - before
            if all(done):
                break
            # slots past each row's accepted prefix become holes
            keep = (torch.arange(K + 1, device=dev)[None] <= acc[:, None]).to(mask.dtype)
            mask = torch.cat([mask, keep], dim=-1)  # [B, L + K + 1]
            # the draft catches up on the verified slots: [Emb(next token); h] per slot
            o_all = draft(toks, hid, vpos, mask, dcache)  # [B, K+1, H]
            o = o_all[rows, acc]  # [B, H] at the new pending token's predecessor
            tok = toks[rows, acc]  # [B] the new pending token
            at = at + acc + 1
    finally:
        grab.close()
    return [(out_ids[i], out_lps[i], reasons[i]) for i in range(B)], stats
