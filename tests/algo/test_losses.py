"""GSPO / GSPO-token / GRPO against float64 references written from the formulas."""

import math

import pytest
import torch

from megatron_gspo.algo.losses import finalize_stats, grpo_loss, gspo_loss, gspo_token_loss


def _case(seed, b=6, t=9, scale=0.3, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    mask = (torch.rand(b, t, generator=g) > 0.3).to(torch.float64)
    if empty_row:
        mask[1] = 0
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    adv[0] = abs(adv[0]) + 0.1
    adv[2] = -abs(adv[2]) - 0.1
    return logp, old, mask, adv


def _ref_gspo(logp, old, mask, adv, el, eh, n):
    """L = -(1/N) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(logp - old))."""
    total = 0.0
    for i in range(logp.shape[0]):
        m = mask[i] > 0
        if m.sum() == 0:
            continue
        s = torch.exp((logp[i][m] - old[i][m]).sum() / m.sum())
        c = torch.clamp(s, 1 - el, 1 + eh)
        total = total - torch.minimum(s * adv[i], c * adv[i])
    return total / n


def _ref_gspo_token(logp, old, mask, adv_tok, el, eh, n):
    total = 0.0
    for i in range(logp.shape[0]):
        m = mask[i] > 0
        k = int(m.sum())
        if k == 0:
            continue
        s = torch.exp((logp[i][m] - old[i][m]).sum() / k).detach()
        lp = logp[i][m]
        s_t = s * torch.exp(lp - lp.detach())
        a = adv_tok[i][m]
        total = total - torch.minimum(s_t * a, torch.clamp(s_t, 1 - el, 1 + eh) * a).sum() / k
    return total / n


def _ref_grpo(logp, old, mask, adv, el, eh, agg):
    terms, per_seq = [], []
    for i in range(logp.shape[0]):
        m = mask[i] > 0
        if m.sum() == 0:
            continue
        r = torch.exp(logp[i][m] - old[i][m])
        a = adv[i]
        term = -torch.minimum(r * a, torch.clamp(r, 1 - el, 1 + eh) * a)
        terms.append(term)
        per_seq.append(term.mean())
    if agg == "token-mean":
        return torch.cat(terms).sum() / sum(len(t) for t in terms)
    return sum(per_seq) / len(per_seq)


def _grad(fn, logp):
    x = logp.clone().requires_grad_(True)
    out = fn(x)
    out = out[0] if isinstance(out, tuple) else out
    (g,) = torch.autograd.grad(out, x)
    return out.detach(), g


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale", [0.0005, 0.3])
def test_gspo_matches_float64_reference(seed, scale):
    logp, old, mask, adv = _case(seed, scale=scale)
    el, eh = 3e-4, 4e-4
    n = 7  # a global count larger than the local rows
    v, g = _grad(lambda x: gspo_loss(x.float(), old.float(), adv.float(), mask, eps_low=el,
                                     eps_high=eh, num_sequences=n), logp)
    rv, rg = _grad(lambda x: _ref_gspo(x, old, mask, adv, el, eh, n), logp)
    assert torch.allclose(v.double(), rv, atol=1e-6, rtol=1e-6)
    assert torch.allclose(g.double(), rg, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_gspo_token_matches_reference(seed):
    logp, old, mask, _ = _case(seed, scale=0.0004)
    g = torch.Generator().manual_seed(100 + seed)
    adv_tok = torch.randn(logp.shape, generator=g, dtype=torch.float64)
    el, eh = 3e-4, 4e-4
    v, gr = _grad(lambda x: gspo_token_loss(x.float(), old.float(), adv_tok.float(), mask,
                                            eps_low=el, eps_high=eh), logp)
    rv, rg = _grad(lambda x: _ref_gspo_token(x, old, mask, adv_tok, el, eh, 5), logp)
    assert torch.allclose(v.double(), rv, atol=1e-6, rtol=1e-6)
    assert torch.allclose(gr.double(), rg, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_grpo_matches_reference(seed, agg):
    logp, old, mask, adv = _case(seed, scale=0.3)
    v, g = _grad(lambda x: grpo_loss(x.float(), old.float(), adv.float(), mask,
                                     aggregation=agg), logp)
    rv, rg = _grad(lambda x: _ref_grpo(x, old, mask, adv, 0.2, 0.28, agg), logp)
    assert torch.allclose(v.double(), rv, atol=1e-6, rtol=1e-6)
    assert torch.allclose(g.double(), rg, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale", [0.0002, 0.01, 0.5])
def test_gspo_token_equals_gspo_with_constant_token_advantages(seed, scale):
    logp, old, mask, adv = _case(seed, scale=scale)
    adv_tok = adv[:, None].expand_as(logp)
    v1, g1 = _grad(lambda x: gspo_loss(x.float(), old.float(), adv.float(), mask), logp)
    v2, g2 = _grad(lambda x: gspo_token_loss(x.float(), old.float(), adv_tok.float(), mask),
                   logp)
    assert torch.allclose(v1, v2, atol=1e-7, rtol=1e-6)
    assert torch.allclose(g1, g2, atol=1e-7, rtol=1e-5)
    _, s1 = gspo_loss(logp.float(), old.float(), adv.float(), mask)
    _, s2 = gspo_token_loss(logp.float(), old.float(), adv_tok.float(), mask)
    for k in ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio_mean"):
        assert torch.allclose(s1[k], s2[k]), k


def test_worked_numbers_from_the_paper_blog():
    ratios = torch.tensor([[1.2, 0.9, 1.0, 1.1]])
    loss, st = gspo_loss(torch.log(ratios), torch.zeros(1, 4), torch.tensor([1.0]),
                         torch.ones(1, 4))
    assert st["ratio_mean"].item() == pytest.approx(1.0440, abs=5e-5)
    assert st["clip_fraction"].item() == 1.0  # 1.044 > 1 + 4e-4: whole sequence clipped

    lp = torch.zeros(1, 100)
    lp[0, 37] = math.log(10.0)
    loss, st = gspo_loss(lp, torch.zeros(1, 100), torch.tensor([2.0]), torch.ones(1, 100))
    assert st["ratio_mean"].item() == pytest.approx(10 ** (1 / 100), abs=1e-6)
    assert st["ratio_mean"].item() == pytest.approx(1.0233, abs=5e-5)
    assert st["clip_fraction"].item() == 1.0 and st["clip_fraction_high"].item() == 1.0
    assert st["clipped_tokens"].item() == 100
    # Clipped: the loss is the clipped value and no gradient flows.
    x = lp.clone().requires_grad_(True)
    loss, _ = gspo_loss(x, torch.zeros(1, 100), torch.tensor([2.0]), torch.ones(1, 100))
    assert loss.item() == pytest.approx(-2.0 * (1 + 4e-4), rel=1e-6)
    (g,) = torch.autograd.grad(loss, x)
    assert torch.count_nonzero(g) == 0


def test_clip_fraction_counts_tokens_of_clipped_sequences():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.float32)
    lp = torch.zeros(3, 4)
    lp[0, :3] = 0.01   # s = e^0.01 > 1 + eps_high, A > 0 -> high clip (3 tokens)
    lp[1, 0] = -0.01   # s < 1 - eps_low, A < 0 -> low clip (1 token)
    adv = torch.tensor([1.0, -1.0, 1.0])
    _, st = gspo_loss(lp, torch.zeros(3, 4), adv, mask)
    assert st["trainable_tokens"].item() == 6
    assert st["clip_fraction_high"].item() == pytest.approx(3 / 6)
    assert st["clip_fraction_low"].item() == pytest.approx(1 / 6)
    assert st["clip_fraction"].item() == pytest.approx(4 / 6)
    fin = finalize_stats(st)
    assert fin["clip_fraction"].item() == pytest.approx(4 / 6)


def test_empty_rows_and_huge_log_ratios_stay_finite():
    lp = torch.tensor([[80.0, -80.0, 0.0], [-80.0, -80.0, -80.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[-80.0, 80.0, 0.0], [80.0, 80.0, 80.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0, 5.0])
    for fn, a in ((gspo_loss, adv), (gspo_token_loss, adv[:, None].expand(3, 3)),
                  (grpo_loss, adv)):
        x = lp.clone().requires_grad_(True)
        loss, st = fn(x, old, a, mask)
        (g,) = torch.autograd.grad(loss, x)
        assert torch.isfinite(loss) and torch.isfinite(g).all(), fn.__name__
        assert st["logratio_bound_hits"].item() >= 1
        assert torch.all(g[2] == 0)  # the empty row gets no gradient
        assert all(torch.isfinite(v) for v in st.values())
    # A row with -inf garbage under mask 0 adds nothing and yields no NaN.
    lp2 = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    loss, _ = gspo_loss(lp2, torch.tensor([[-1.0, float("-inf")]]), torch.tensor([1.0]),
                        torch.tensor([[1.0, 0.0]]))
    (g,) = torch.autograd.grad(loss, lp2)
    assert torch.isfinite(loss) and torch.isfinite(g).all()


def test_all_rows_empty_gives_zero_loss():
    x = torch.zeros(2, 3, requires_grad=True)
    for fn in (gspo_loss, grpo_loss):
        loss, st = fn(x, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
        assert loss.item() == 0.0 and st["clip_fraction"].item() == 0.0


def test_num_sequences_makes_micro_batches_additive():
    logp, old, mask, adv = _case(3, b=8, empty_row=False)
    lp, old, adv = logp.float(), old.float(), adv.float()
    full, _ = gspo_loss(lp, old, adv, mask)
    parts = sum(gspo_loss(lp[i:i + 3], old[i:i + 3], adv[i:i + 3], mask[i:i + 3],
                          num_sequences=8)[0] for i in (0, 3, 6))
    assert torch.allclose(full, parts, atol=1e-7)
    tok_full, _ = grpo_loss(lp, old, adv, mask, aggregation="token-mean")
    n_tok = mask.sum()
    tok_parts = sum(grpo_loss(lp[i:i + 4], old[i:i + 4], adv[i:i + 4], mask[i:i + 4],
                              aggregation="token-mean", num_tokens=n_tok)[0] for i in (0, 4))
    assert torch.allclose(tok_full, tok_parts, atol=1e-7)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="shape mismatch"):
        gspo_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages has 3 rows"):
        gspo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="aggregation"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3),
                  aggregation="sum")
