"""Speculative sampling's verification (`algo.speculative_sampling.verify_chain`, Leviathan et
al. arXiv 2211.17192): generated sequences follow the target's distribution exactly.

A toy "model" over a 4-token vocabulary: the target's and the draft's next-token distributions
depend on the last two tokens (fixed random tables, the draft deliberately different so that
about half the drafts are rejected). 40,000 rows generate 3 tokens each by drafting K-chains and
verifying them, batched; the 64 possible sequences' frequencies are tested against their exact
probabilities (chi-square below its mean + 6 standard deviations). The same harness with a
wrong rule (resampling from p instead of norm(max(p - q, 0)) at a rejection, or accepting every
draft) exceeds 3x that bound, which shows the test can fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_gspo.algo.speculative_sampling import emitted_logprobs, verify_chain

V, N, ROWS = 4, 3, 40_000


def _bound(dof: int) -> float:
    """dof + 6 standard deviations of chi-square(dof): a correct sampler passes but for a
    ~1e-4 chance (the seed is fixed: the result is deterministic)."""
    return dof + 6 * (2 * dof) ** 0.5


def _tables(top2: bool):
    g = torch.Generator().manual_seed(5)
    tp = torch.randn(V + 1, V + 1, V, generator=g) * 1.5  # [prev2, prev1, V] (V = start)
    tq = torch.randn(V + 1, V + 1, V, generator=g) * 1.5
    if top2:  # the engine's top-k filtering: both distributions over each row's top-2 only
        for t in (tp, tq):
            kth = t.topk(2, dim=-1).values[..., -1:]
            t.masked_fill_(t < kth, float("-inf"))
    return tp.softmax(-1), tq.softmax(-1)


def _dist(table, seq, lens, extra):
    """table rows for each row's last two tokens, seq[:lens] then `extra` [B, j]: [B, V]."""
    b, j = torch.arange(seq.shape[0]), extra.shape[1]
    start = torch.full_like(lens, V)

    def tok(back):  # the token `back` places before the end (start token before the sequence)
        if back <= j:
            return extra[:, j - back]
        i = lens - (back - j)
        return torch.where(i >= 0, seq[b, i.clamp(min=0)], start)

    return table[tok(2), tok(1)]


def _generate(K: int, top2: bool, rule: str = "exact", greedy: bool = False) -> torch.Tensor:
    """[ROWS, N] sequences generated with K-token draft chains."""
    tp, tq = _tables(top2)
    gen = torch.Generator().manual_seed(1234)
    seq = torch.zeros(ROWS, N + K + 1, dtype=torch.long)
    lens = torch.zeros(ROWS, dtype=torch.long)
    rows = torch.arange(ROWS)

    def draw(probs):
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

    while bool((lens < N).any()):
        drafts, qs = [], []
        for _ in range(K):
            d = torch.stack(drafts, 1) if drafts else seq[:, :0]
            q = _dist(tq, seq, lens, d)
            qs.append(q)
            drafts.append(q.argmax(-1) if greedy else draw(q))
        draft = torch.stack(drafts, 1)  # [B, K]
        p = torch.stack([_dist(tp, seq, lens, draft[:, :j]) for j in range(K + 1)],
                        1)  # [B, K+1, V]
        q = torch.stack(qs, 1)  # [B, K, V]
        u = torch.rand(ROWS, K, generator=gen)
        if rule == "exact":
            g = torch.full((ROWS,), greedy)
            acc, toks = verify_chain(p, q, draft, u, draw, greedy=g, target_argmax=p.argmax(-1))
        elif rule == "resample_from_p":  # wrong: ignores the draft's share at a rejection
            acc, toks = verify_chain(p, q, draft, u, draw)
            resid_fix = draw(p[rows, acc])
            toks[rows, acc] = torch.where(acc < K, resid_fix, toks[rows, acc])
        else:  # "accept_all": wrong, samples the draft
            acc = torch.full((ROWS,), K)
            toks = torch.cat([draft, draw(p[:, K])[:, None]], 1)
        for j in range(K + 1):  # append the accepted + 1 emitted tokens
            take = (j <= acc) & (lens < N + K + 1)
            seq[rows[take], lens[take]] = toks[take, j]
            lens = lens + take.long()
    return seq[:, :N]


def _exact(top2: bool) -> torch.Tensor:
    tp, _ = _tables(top2)
    out = torch.zeros(V ** N, dtype=torch.float64)
    for i, s in enumerate(itertools.product(range(V), repeat=N)):
        pr, hist = 1.0, [V, V]
        for t in s:
            pr *= float(tp[hist[-2], hist[-1], t])
            hist.append(t)
        out[i] = pr
    return out


def _chi2(samples: torch.Tensor, top2: bool) -> tuple[float, int]:
    codes = (samples * torch.tensor([V ** (N - 1 - i) for i in range(N)])).sum(-1)
    counts = torch.bincount(codes, minlength=V ** N).double()
    expected = _exact(top2) * samples.shape[0]
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a sequence of probability 0 was sampled"
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return chi2, int(keep.sum()) - 1


@pytest.mark.parametrize("K,top2", [(1, False), (3, False), (2, True)])
def test_speculative_sequences_follow_the_target_distribution(K, top2):
    chi2, dof = _chi2(_generate(K, top2), top2)
    print(f"\nK={K} top2={top2}: chi2 {chi2:.1f} ({dof} dof, bound {_bound(dof):.0f})")
    assert chi2 < _bound(dof)


@pytest.mark.parametrize("rule", ["resample_from_p", "accept_all"])
def test_a_wrong_acceptance_rule_is_detected(rule):
    chi2, dof = _chi2(_generate(2, False, rule), False)
    print(f"\n{rule}: chi2 {chi2:.1f} ({dof} dof)")
    assert chi2 > 3 * _bound(dof)


def test_greedy_rows_give_the_target_argmax_chain():
    tp, _ = _tables(False)
    seq = _generate(2, False, greedy=True)
    hist, want = [V, V], []
    for _ in range(N):
        t = int(tp[hist[-2], hist[-1]].argmax())
        want.append(t)
        hist.append(t)
    assert (seq == torch.tensor(want)).all()


def test_acceptance_counts_and_emitted_tokens():
    p = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]]])  # [1, K+1=3, V=2]
    q = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])  # drafts 1 then 1
    draft = torch.tensor([[1, 1]])
    acc, toks = verify_chain(p, q, draft, torch.zeros(1, 2), lambda pr: pr.argmax(-1))
    assert int(acc) == 1  # second draft has p = 0: rejected
    assert toks[0, :2].tolist() == [1, 0]  # residual max(p - q, 0) = [1, 0]
    logp = torch.log(torch.tensor([[[0.25, 0.75]] * 3]))
    assert torch.equal(emitted_logprobs(logp, toks), logp[0, 0, toks[0]].unsqueeze(0))
    with pytest.raises(ValueError, match="shapes disagree"):
        verify_chain(p, q[:, :1], draft, torch.zeros(1, 2), lambda pr: pr.argmax(-1))
