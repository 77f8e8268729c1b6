"""Speculative sampling: exact verification of a chain of draft tokens against the target model
(Leviathan et al., arXiv 2211.17192, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al., arXiv 2302.01318, "Accelerating Large Language Model Decoding with
Speculative Sampling").

A draft proposes K tokens d_1..d_K, d_j ~ q_j (the draft's distribution given the prefix and
d_<j); the target scores all of them in one forward, giving p_1..p_{K+1} (p_j: the target's
distribution of token j given the prefix and d_<j). Going left to right, d_j is accepted with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection j the emitted token is drawn
from norm(max(p_j - q_j, 0)); when all K are accepted a bonus token is drawn from p_{K+1}. Every
emitted token is then an exact sample of p given its prefix (Leviathan et al., appendix A.1), so
a row emits (accepted + 1) tokens distributed exactly as plain sampling from the target.
Greedy rows: d_j is accepted iff it equals the target's argmax, the emitted token after the
last accepted draft is the target's argmax: the same tokens as plain greedy decoding.

p and q are the distributions the engine samples from: softmax of the temperature-scaled logits
after the same top-k / top-p filtering for both (any q is exact, as long as the drafts were drawn
from it). The log-probs an engine returns are the target's, not computed here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["verify_chain", "emitted_logprobs"]


def verify_chain(
    p: torch.Tensor,
    q: torch.Tensor,
    draft: torch.Tensor,
    u: torch.Tensor,
    draw: Callable[[torch.Tensor], torch.Tensor],
    greedy: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's draft chain and draw the token that follows it.

    Args:
        p: [B, K+1, V] target probabilities at the K draft positions and the bonus position.
        q: [B, K, V] draft probabilities the drafts were drawn from.
        draft: [B, K] long, the draft tokens.
        u: [B, K] uniforms in [0, 1), one per draft token (the acceptance draws).
        draw: maps [B, V] probabilities to [B] sampled tokens (the engine's sampler: its
            generators, one per row where rows have their own seed).
        greedy: [B] bool, rows decoded greedily (default none).
        target_argmax: [B, K+1] the target's argmax token per position (greedy rows; taken from
            the logits, not from `p`, to break ties as plain decoding does).
    Returns:
        accepted: [B] long in [0, K], the drafts accepted per row;
        tokens: [B, K+1] long, the row's emitted tokens in its first accepted + 1 entries
            (draft[:, :accepted] then the residual / bonus token); later entries are drafts.
    """
    if p.dim() != 3 or q.dim() != 3 or draft.dim() != 2:
        raise ValueError(f"verify_chain: p [B, K+1, V], q [B, K, V], draft [B, K] expected, got "
                         f"{tuple(p.shape)}, {tuple(q.shape)}, {tuple(draft.shape)}")
    B, K1, V = p.shape
    K = K1 - 1
    if tuple(q.shape) != (B, K, V) or tuple(draft.shape) != (B, K) or tuple(u.shape) != (B, K):
        raise ValueError(f"verify_chain: shapes disagree: p {tuple(p.shape)}, q "
                         f"{tuple(q.shape)}, draft {tuple(draft.shape)}, u {tuple(u.shape)}")
    if K < 1:
        raise ValueError("verify_chain: a chain of at least one draft token is needed")
    rows = torch.arange(B, device=p.device)
    idx = draft.unsqueeze(-1)  # [B, K, 1]
    p_d = p[:, :K].gather(-1, idx).squeeze(-1)  # [B, K] target prob of each draft token
    q_d = q.gather(-1, idx).squeeze(-1)  # [B, K] draft prob of each draft token
    ok = u * q_d < p_d  # [B, K] u < p/q: accepted with probability min(1, p/q)
    if greedy is not None and bool(greedy.any()):
        if target_argmax is None:
            raise ValueError("verify_chain: greedy rows need target_argmax")
        ok = torch.where(greedy.unsqueeze(-1), draft == target_argmax[:, :K], ok)
    accepted = ok.long().cumprod(-1).sum(-1)  # [B] length of the accepted prefix
    p_at = p[rows, accepted]  # [B, V] target distribution after the accepted prefix
    q_at = q[rows, accepted.clamp(max=K - 1)]  # [B, V] (unused where all K were accepted)
    resid = (p_at - q_at).clamp(min=0)  # [B, V] norm(max(p - q, 0)) at the first rejection
    full = (accepted == K).unsqueeze(-1)  # [B, 1]
    resid = torch.where(full, p_at, resid)
    mass = resid.sum(-1, keepdim=True)  # [B, 1]
    # p == q up to rounding leaves no residual mass; such a rejection has probability ~0 and p
    # itself is then the residual's limit
    resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), p_at)
    last = draw(resid)  # [B]
    if greedy is not None and bool(greedy.any()):
        last = torch.where(greedy, target_argmax[rows, accepted], last)
    tokens = torch.cat([draft, draft[:, -1:]], dim=-1).clone()  # [B, K+1]
    tokens[rows, accepted] = last
    return accepted, tokens


def emitted_logprobs(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Target log-probs of the candidate tokens: logp [B, K+1, V] (full-vocabulary
    log_softmax(logits / T)) gathered at tokens [B, K+1] -> [B, K+1]."""
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
