"""SAPO, CISPO, GMPO and Dr. GRPO's aggregation against float64 references written from each
paper's formula: values, and gradients by central finite differences of the reference."""

import math

import pytest
import torch

from megatron_gspo.algo.cispo import cispo_loss
from megatron_gspo.algo.gmpo import gmpo_loss
from megatron_gspo.algo.losses import grpo_loss
from megatron_gspo.algo.sapo import sapo_loss


def _case(seed, b=6, t=9, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    mask = (torch.rand(b, t, generator=g) > 0.3).to(torch.float64)
    mask[1] = 0  # a row without trainable tokens
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    adv[0], adv[2] = abs(adv[0]) + 0.1, -abs(adv[2]) - 0.1
    return logp, old, mask, adv


def _rows(mask):
    return [(i, [t for t in range(mask.shape[1]) if mask[i, t] > 0]) for i in range(mask.shape[0])]


# ---- the papers' formulas, float64, one python term at a time -------------------------------
def ref_sapo(logp, old, mask, adv_tok, tau_pos, tau_neg, n):
    """SAPO eq.: J = (1/N) sum_i (1/|y_i|) sum_t (4/tau) sigmoid(tau (r - 1)) A_it."""
    total = 0.0
    for i, ts in _rows(mask):
        if not ts:
            continue
        s = 0.0
        for t in ts:
            r = math.exp(logp[i, t] - old[i, t])
            a = float(adv_tok[i, t])
            tau = tau_pos if a > 0 else tau_neg
            s += 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0))) * a
        total += s / len(ts)
    return -total / n


def ref_cispo(logp, old, mask, adv_tok, el, eh, n_tok, weights=None):
    """MiniMax-M1 eq. 4: J = (1/sum|y|) sum_i sum_t sg(clip(r, 1-el, 1+eh)) A log pi; with
    `weights` given, they are the stopped-gradient clipped ratios (for finite differences)."""
    total = 0.0
    for i, ts in _rows(mask):
        for t in ts:
            w = weights[i][t] if weights is not None else \
                min(max(math.exp(logp[i, t] - old[i, t]), 1 - el), 1 + eh)
            total += w * float(adv_tok[i, t]) * logp[i, t]
    return -total / n_tok


def ref_gmpo(logp, old, mask, adv, el, eh, n):
    """GMPO: J = (1/N) sum_i (prod_t |min(r A, clip(r, e^-el, e^eh) A)|)^(1/|y_i|) sign(A)."""
    total = 0.0
    for i, ts in _rows(mask):
        if not ts:
            continue
        a = float(adv[i])
        logprod = 0.0
        for t in ts:
            r = math.exp(logp[i, t] - old[i, t])
            c = min(max(r, math.exp(-el)), math.exp(eh))
            logprod += math.log(abs(min(r * a, c * a)))
        total += math.exp(logprod / len(ts)) * (1.0 if a > 0 else -1.0)
    return -total / n


def fd_grad(f, logp, h=1e-6):
    """Central finite differences of f over every entry of logp (float64)."""
    g = torch.zeros_like(logp)
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in logp.shape]):
        i, t = int(idx[0]), int(idx[1])
        up, dn = logp.clone(), logp.clone()
        up[i, t] += h
        dn[i, t] -= h
        g[i, t] = (f(up) - f(dn)) / (2 * h)
    return g


def _ours(fn, logp, old, mask, adv, **kw):
    lp = logp.float().clone().requires_grad_(True)
    loss, stats = fn(lp, old.float(), adv.float(), mask.float(), **kw)
    loss.backward()
    return float(loss.detach()), lp.grad.double(), stats


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("token_adv", [False, True])
def test_sapo_value_and_gradient_match_the_paper(seed, token_adv):
    logp, old, mask, adv = _case(seed)
    adv_tok = adv[:, None].expand_as(mask).clone()
    if token_adv:
        adv_tok = adv_tok + 0.5 * torch.randn(adv_tok.shape, dtype=torch.float64,
                                              generator=torch.Generator().manual_seed(seed))
    n = 7.0
    val, grad, st = _ours(sapo_loss, logp, old, mask, adv_tok if token_adv else adv,
                          tau_pos=1.0, tau_neg=1.05, num_sequences=n)
    f = lambda x: ref_sapo(x, old, mask, adv_tok, 1.0, 1.05, n)  # noqa: E731
    assert val == pytest.approx(f(logp), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad * mask, fd_grad(f, logp) * mask, rtol=1e-4, atol=1e-6)
    assert float(st["clipped_tokens"]) == 0.0  # no clip in SAPO


def test_sapo_on_policy_gradient_is_plain_policy_gradient():
    """w(r = 1) = 4 sigmoid'(0) = 1: at pi = pi_old SAPO's gradient is -A / (|y| N)."""
    logp, _, mask, adv = _case(3)
    _, grad, _ = _ours(sapo_loss, logp, logp, mask, adv, num_sequences=5.0)
    count = mask.sum(-1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(grad, -(adv[:, None] * mask / count / 5.0), rtol=1e-6,
                               atol=1e-8)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("eps", [(1.0, 0.28), (0.2, 0.1)])
def test_cispo_value_and_gradient_match_the_paper(seed, eps):
    logp, old, mask, adv = _case(seed, scale=0.4)
    adv_tok = adv[:, None].expand_as(mask)
    el, eh = eps
    n_tok = float(mask.sum()) + 3.0  # a global count larger than the local one
    val, grad, st = _ours(cispo_loss, logp, old, mask, adv, eps_low=el, eps_high=eh,
                          num_tokens=n_tok)
    w = [[min(max(math.exp(logp[i, t] - old[i, t]), 1 - el), 1 + eh)
          for t in range(mask.shape[1])] for i in range(mask.shape[0])]
    # value: -(1/N_tok) sum sg(r^) A; gradient: that of the paper's sg(r^) A log pi
    want = -sum(w[i][t] * float(adv[i]) for i, ts in _rows(mask) for t in ts) / n_tok
    assert val == pytest.approx(want, rel=1e-5)
    f = lambda x: ref_cispo(x, old, mask, adv_tok, el, eh, n_tok, weights=w)  # noqa: E731
    torch.testing.assert_close(grad * mask, fd_grad(f, logp) * mask, rtol=1e-4, atol=1e-6)
    assert float(st["clipped_tokens"]) > 0  # the case exercises the truncation


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """Unlike the PPO clip, a token far above 1 + eps_high still gets gradient (1+eps) A."""
    lp = torch.tensor([[-0.1, -1.0]], requires_grad=True)
    old = torch.tensor([[-2.0, -1.0]])  # ratio e^1.9 and 1
    loss, st = cispo_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), eps_high=0.28)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28 / 2, -1.0 / 2]]))
    assert float(st["clipped_tokens_high"]) == 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gmpo_value_and_gradient_match_the_paper(seed):
    logp, old, mask, adv = _case(seed, scale=0.5)
    n = 6.0
    val, grad, st = _ours(gmpo_loss, logp, old, mask, adv, eps_low=0.4, eps_high=0.4,
                          num_sequences=n)
    f = lambda x: ref_gmpo(x, old, mask, adv, 0.4, 0.4, n)  # noqa: E731
    assert val == pytest.approx(f(logp), rel=1e-5)
    torch.testing.assert_close(grad * mask, fd_grad(f, logp) * mask, rtol=1e-4, atol=1e-6)
    assert float(st["clipped_tokens"]) > 0


def test_gmpo_rejects_per_token_advantages():
    logp, old, mask, adv = _case(0)
    with pytest.raises(ValueError, match="one advantage per sequence"):
        gmpo_loss(logp.float(), old.float(), adv[:, None].expand_as(mask).float(), mask.float())


@pytest.mark.parametrize("fn", [sapo_loss, cispo_loss, gmpo_loss])
def test_empty_rows_garbage_and_huge_log_ratios_stay_finite(fn):
    lp = torch.tensor([[-1.0, float("-inf")], [-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-80.0, float("nan")], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    loss, st = fn(lp, old, torch.tensor([1.0, -1.0]), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert float(st["logratio_bound_hits"]) == 1.0
    assert lp.grad[1].abs().sum() == 0


def test_dr_grpo_aggregation_divides_token_sums_by_a_constant_length():
    """Dr. GRPO: L = -(1/(N L)) sum_i sum_t min(r A, clip(r) A): no 1/|y_i| and so no bias
    towards short correct / long wrong answers."""
    logp, old, mask, adv = _case(4)
    val, _, _ = _ours(grpo_loss, logp, old, mask, adv, aggregation="seq-mean-token-sum-norm",
                      num_sequences=5.0, norm_length=16.0)
    total = 0.0
    for i, ts in _rows(mask):
        for t in ts:
            r = math.exp(logp[i, t] - old[i, t])
            a = float(adv[i])
            total -= min(r * a, min(max(r, 0.8), 1.28) * a)
    assert val == pytest.approx(total / (5.0 * 16.0), rel=1e-5)
    with pytest.raises(ValueError, match="norm_length"):
        grpo_loss(logp.float(), old.float(), adv.float(), mask.float(),
                  aggregation="seq-mean-token-sum-norm")
