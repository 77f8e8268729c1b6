"""Token log-probabilities (and entropy) from logits without a full-vocabulary float32
log_softmax.

`token_logprobs` computes log softmax(logits / temperature)[target] chunk by chunk over tokens:
only `chunk_size x V` float32 values exist at a time, in the forward and in the backward pass
(a custom autograd function saves the logits it was given plus one log-sum-exp per token and
recomputes the softmax of each chunk in backward). This is the single-rank version; the
vocabulary-parallel one lives in `megatron_gspo.megatron.logprobs`.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 1024

__all__ = ["token_logprobs", "DEFAULT_CHUNK_SIZE"]


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_forward(logits_2d, targets_1d, temperature, chunk_size, want_entropy):
    n = logits_2d.shape[0]
    cd = _compute_dtype(logits_2d.dtype)
    logp = torch.empty(n, dtype=cd, device=logits_2d.device)  # [N]
    lse = torch.empty(n, dtype=cd, device=logits_2d.device)  # [N]
    ent = torch.empty(n, dtype=cd, device=logits_2d.device) if want_entropy else None
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        z = logits_2d[s:e].to(cd, copy=True)  # [C, V], own copy: edited in place
        if temperature != 1.0:
            z.div_(temperature)
        c_lse = torch.logsumexp(z, dim=-1)  # [C]
        lse[s:e] = c_lse
        logp[s:e] = z.gather(-1, targets_1d[s:e, None]).squeeze(-1) - c_lse
        if want_entropy:
            # H = lse - sum_v p_v z_v
            z.sub_(c_lse[:, None])  # log p
            ent[s:e] = -(z.exp() * z).sum(-1)
        del z
    return logp, lse, ent


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_2d, targets_1d, temperature, chunk_size):
        logp, lse, _ = _chunk_forward(logits_2d, targets_1d, temperature, chunk_size, False)
        ctx.save_for_backward(logits_2d, targets_1d, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logp

    @staticmethod
    def backward(ctx, grad_out):  # grad_out [N]
        logits_2d, targets_1d, lse = ctx.saved_tensors
        t, cs = ctx.temperature, ctx.chunk_size
        grad = torch.empty_like(logits_2d)
        cd = _compute_dtype(logits_2d.dtype)
        g = grad_out.to(cd)
        for s in range(0, logits_2d.shape[0], cs):
            e = min(s + cs, logits_2d.shape[0])
            z = logits_2d[s:e].to(cd, copy=True)  # [C, V], own copy: edited in place
            if t != 1.0:
                z.div_(t)
            p = z.sub_(lse[s:e, None]).exp_()  # softmax, in place
            # d logp / d logits = (onehot - p) / T
            p.mul_(-g[s:e, None] / t)
            p.scatter_add_(-1, targets_1d[s:e, None], (g[s:e] / t)[:, None])
            grad[s:e] = p.to(grad.dtype)
            del p, z
        return grad, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
):
    """Log-probabilities of `targets` under softmax(logits / temperature), in float32.

    Args:
        logits: `[..., V]` logits of any float dtype (gradients flow back to them).
        targets: `[...]` token ids, same leading shape as logits.
        temperature: sampling temperature the tokens were drawn with (> 0).
        chunk_size: tokens processed at once (bounds the float32 working set to chunk x V).
        return_entropy: also return the entropy of each token's distribution (detached; a
            metric, not differentiated).
    Returns:
        `[...]` float32 log-probs (float64 for float64 logits), or `(logprobs, entropy)` when return_entropy.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree"
        )
    lead = targets.shape
    v = logits.shape[-1]
    logits_2d = logits.reshape(-1, v)  # [N, V]
    targets_1d = targets.reshape(-1).long()  # [N]
    if targets_1d.numel() and (targets_1d.min() < 0 or targets_1d.max() >= v):
        raise ValueError(f"target ids must lie in [0, {v}), got [{targets_1d.min()}, "
                         f"{targets_1d.max()}]")
    chunk_size = max(1, int(chunk_size))
    if logits_2d.requires_grad and torch.is_grad_enabled():
        logp = _TokenLogProbs.apply(logits_2d, targets_1d, float(temperature), chunk_size)
        ent = None
        if return_entropy:
            with torch.no_grad():
                _, _, ent = _chunk_forward(logits_2d.detach(), targets_1d, temperature,
                                           chunk_size, True)
    else:
        logp, _, ent = _chunk_forward(logits_2d, targets_1d, temperature, chunk_size,
                                      return_entropy)
    logp = logp.reshape(lead)
    if return_entropy:
        return logp, ent.reshape(lead)
    return logp
