"""Token log-probabilities (and entropy) from logits without a full-vocabulary float32
log_softmax.

`token_logprobs` computes log softmax(logits / temperature)[target] chunk by chunk over tokens:
only `chunk_size x V` float32 values exist at a time (about 256 MiB by default), in the forward
and in the backward pass
(a custom autograd function saves the logits it was given plus one log-sum-exp per token and
recomputes the softmax of each chunk in backward). This is the single-rank version; the
vocabulary-parallel one lives in `megatron_gspo.megatron.tp_logprobs`.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = None  # None: chunks of about CHUNK_BYTES of float32 values
CHUNK_BYTES = 256 * 2**20

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
        z = logits_2d[s:e]  # [C, V]
        if temperature != 1.0:
            z = z.to(cd) / temperature
        ls = torch.log_softmax(z, dim=-1, dtype=cd)  # [C, V], fused kernel, one buffer
        tgt = targets_1d[s:e, None]
        logp[s:e] = ls.gather(-1, tgt).squeeze(-1)
        lse[s:e] = z.gather(-1, tgt).squeeze(-1).to(cd) - logp[s:e]
        if want_entropy:
            ent[s:e] = -(ls.exp() * ls).sum(-1)
        del ls, z
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
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
):
    """Log-probabilities of `targets` under softmax(logits / temperature), in float32.

    Args:
        logits: `[..., V]` logits of any float dtype (gradients flow back to them).
        targets: `[...]` token ids, same leading shape as logits.
        temperature: sampling temperature the tokens were drawn with (> 0).
        chunk_size: tokens processed at once (bounds the float32 working set to chunk x V);
            None picks chunks of about 256 MiB of float32 values.
        return_entropy: also return the entropy of each token's distribution (detached; a
            metric, not differentiated).
    Returns:
        `[...]` float32 log-probs (float64 for float64 logits), or `(logprobs, entropy)`
        when return_entropy.
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
    if chunk_size is None:
        chunk_size = CHUNK_BYTES // (4 * v)
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
