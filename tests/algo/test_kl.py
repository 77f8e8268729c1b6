"""KL estimators, placements and entropy bonus against float64 references written from the
formulas of `megatron_gspo.algo.kl` (values, gradients, masks, empty rows)."""

import math

import pytest
import torch

from megatron_gspo.algo import kl


def _ref_token(d, est):
    if est == "k1":
        return d
    if est == "k2":
        return 0.5 * d * d
    return math.exp(-d) - 1.0 + d


def _ref_loss(lp, ref, mask, est, coef, aggregation):
    """Loops in float64: per-sequence mean over trainable tokens / N, or token mean."""
    B, T = lp.shape
    tot, n_seq, n_tok = 0.0, 0, 0
    for i in range(B):
        toks = [_ref_token(float(lp[i, t]) - float(ref[i, t]), est)
                for t in range(T) if mask[i, t] > 0]
        if not toks:
            continue
        n_seq += 1
        n_tok += len(toks)
        tot += sum(toks) / len(toks) if aggregation == "seq-mean-token-mean" else sum(toks)
    n = n_seq if aggregation == "seq-mean-token-mean" else n_tok
    return coef * tot / max(n, 1)


def _data():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3  # [B, T]
    ref = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 1, 1, 1, 1],
                         [0, 1, 1, 1, 0, 0]], dtype=torch.float64)
    lp[1] = float("-inf")  # garbage on the empty row and at masked positions
    lp[0, 5] = float("-inf")
    return lp, ref, mask


@pytest.mark.parametrize("est", kl.ESTIMATORS)
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_kl_loss_value_and_gradient(est, aggregation):
    lp, ref, mask = _data()
    x = lp.clone().requires_grad_(True)
    loss = kl.kl_loss(x, ref, mask, coef=0.05, estimator=est, aggregation=aggregation)
    want = _ref_loss(lp, ref, mask, est, 0.05, aggregation)
    assert torch.isfinite(loss) and abs(loss.item() - want) < 1e-6 * max(1.0, abs(want))
    loss.backward()
    assert torch.isfinite(x.grad).all()
    # float64 central differences of the loop reference at each trainable position
    h = 1e-6
    for i in range(4):
        for t in range(6):
            if mask[i, t] == 0:
                assert x.grad[i, t] == 0
                continue
            up, dn = lp.clone(), lp.clone()
            up[i, t] += h
            dn[i, t] -= h
            num = (_ref_loss(up, ref, mask, est, 0.05, aggregation)
                   - _ref_loss(dn, ref, mask, est, 0.05, aggregation)) / (2 * h)
            assert abs(float(x.grad[i, t]) - num) < 1e-5, (i, t, est)


def test_global_divisors_and_empty_batch():
    lp, ref, mask = _data()
    full = kl.kl_loss(lp, ref, mask, coef=1.0, estimator="k3")
    parts = sum(kl.kl_loss(lp[i:i + 2], ref[i:i + 2], mask[i:i + 2], coef=1.0, estimator="k3",
                           num_sequences=3) for i in (0, 2))
    assert torch.allclose(full, parts, atol=1e-6)
    empty = torch.zeros(2, 3)
    out = kl.kl_loss(torch.full((2, 3), float("-inf")), empty, empty, coef=1.0)
    assert float(out) == 0.0


def test_estimators_at_equal_policies_and_k3_positive():
    x = torch.randn(3, 5)
    for est in kl.ESTIMATORS:
        assert torch.equal(kl.token_kl(x, x, est), torch.zeros(3, 5))
    assert (kl.token_kl(x, torch.randn(3, 5), "k3") >= 0).all()
    with pytest.raises(ValueError, match="k4"):
        kl.token_kl(x, x, "k4")


@pytest.mark.parametrize("est", kl.ESTIMATORS)
def test_kl_in_reward(est):
    lp, ref, mask = _data()
    rewards = torch.tensor([1.0, 0.0, 0.5, -1.0])
    out, seq = kl.kl_reward(rewards, lp, ref, mask, coef=0.1, estimator=est)
    for i in range(4):
        toks = [_ref_token(float(lp[i, t] - ref[i, t]), est) for t in range(6) if mask[i, t]]
        want = sum(toks) / len(toks) if toks else 0.0
        assert abs(float(seq[i]) - want) < 1e-6
        assert abs(float(out[i]) - (float(rewards[i]) - 0.1 * want)) < 1e-6
    assert not out.requires_grad


def test_entropy_loss_is_a_bonus():
    ent = torch.tensor([[1.0, 2.0, 9.0], [0.0, 0.0, 0.0]], dtype=torch.float64,
                       requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = kl.entropy_loss(ent, mask, coef=0.01)
    assert abs(float(out) + 0.01 * 1.5) < 1e-7
    out.backward()
    assert torch.allclose(ent.grad, torch.tensor([[-0.005, -0.005, 0.0], [0, 0, 0]],
                                                 dtype=torch.float64))
    tok = kl.entropy_loss(ent.detach(), mask, coef=0.01, aggregation="token-mean")
    assert abs(float(tok) + 0.015) < 1e-7
