"""Every policy loss through `megatron.step` (single process, hand-built packed rows): the KL
and entropy terms reach the loss for each loss kind, aggregated like its policy term (slime
#397 shipped a KL silently dropped for some losses), and data-parallel shards with the global
divisors add up to the full batch while `loss_func` scales by M x dp exactly once (verl #5798
shipped a sequence-mean divisor dp_size^2 too small). Each check also runs on a re-creation of
the bug and must fail there."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.algo import kl as kl_terms
from megatron_gspo.megatron import step

KINDS = {
    "gspo": dict(kind="gspo", eps_low=3e-4, eps_high=4e-4),
    "gspo_token": dict(kind="gspo_token", eps_low=3e-4, eps_high=4e-4),
    "grpo": dict(kind="grpo", eps_low=0.2, eps_high=0.28),
    "grpo_token_mean": dict(kind="grpo", eps_low=0.2, eps_high=0.28,
                            grpo_aggregation="token-mean"),
    "dr_grpo": dict(kind="grpo", eps_low=0.2, eps_high=0.28,
                    grpo_aggregation="seq-mean-token-sum-norm", norm_length=12.0),
    "sapo": dict(kind="sapo"),
    "cispo": dict(kind="cispo", eps_low=1.0, eps_high=0.28),
    "gmpo": dict(kind="gmpo", eps_low=0.4, eps_high=0.4),
    "gspo_offpolicy_mask": dict(kind="gspo", eps_low=3e-4, eps_high=4e-4,
                                offpolicy_mask_delta=0.01),
}


def _data(rows=slice(None), seed=0, b=6, t=10):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 2 - 0.1
    old = lp + 0.05 * torch.randn(b, t, generator=g)
    ref = lp + 0.2 * torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    mask[4] = 0
    adv = torch.randn(b, generator=g)
    lp, old, ref, mask, adv = (x[rows] for x in (lp, old, ref, mask, adv))
    n, L = mask.shape
    data = {"seq_index": torch.arange(n * L).view(n, L), "seq_valid": torch.ones(n, L, dtype=bool),
            "loss_mask": mask.reshape(-1), "old_logprobs": old.reshape(-1),
            "ref_logprobs": ref.reshape(-1), "advantages": adv[:, None].expand(n, L).reshape(-1),
            "seq_advantages": adv, "token_advantages": False}
    return lp.reshape(-1), data, mask


def _counts(mask):
    return float((mask.sum(-1) > 0).sum()), float(mask.sum())


def _loss(settings, lp, data, n_seq, n_tok, ent=None):
    return step.compute_loss(lp, data, settings, num_sequences=n_seq, num_tokens=n_tok,
                             entropy=ent)


def check_kl_and_entropy_reach_the_loss(compute, name):
    lp, data, mask = _data()
    n_seq, n_tok = _counts(mask)
    ent = torch.rand(lp.shape, generator=torch.Generator().manual_seed(3))
    base = step.LossSettings(**KINDS[name])
    with_terms = step.LossSettings(**KINDS[name], kl_coef=0.1, entropy_coef=0.01)
    off, _ = compute(base, lp, data, n_seq, n_tok)
    on, st = compute(with_terms, lp, data, n_seq, n_tok, ent)
    rows = lambda x: x.view(mask.shape)  # noqa: E731
    agg = base.aggregation()
    kw = dict(aggregation=agg, num_sequences=n_seq, num_tokens=n_tok,
              norm_length=base.norm_length)
    kl = kl_terms.kl_loss(rows(lp), rows(data["ref_logprobs"]), mask, coef=0.1, **kw)
    en = kl_terms.entropy_loss(rows(ent), mask, coef=0.01, **kw)
    assert float(kl) > 0 and float(en) < 0
    assert float(on - off) == pytest.approx(float(kl + en), rel=1e-5), f"{name}: KL dropped"
    assert float(st["kl_loss"]) == pytest.approx(float(kl), rel=1e-6)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_kl_and_entropy_reach_every_loss_aggregated_like_it(name):
    check_kl_and_entropy_reach_the_loss(_loss, name)


def test_the_kl_check_catches_a_loss_that_drops_the_kl():
    def drops_kl_for_cispo(settings, *a, **k):
        if settings.kind == "cispo":
            settings = step.LossSettings(**KINDS["cispo"], entropy_coef=settings.entropy_coef)
        return _loss(settings, *a, **k)

    with pytest.raises(AssertionError, match="KL dropped"):
        check_kl_and_entropy_reach_the_loss(drops_kl_for_cispo, "cispo")


def check_dp_shards_add_up(compute, name, dp=2):
    """Gradient reaching the optimizer = DDP mean over dp ranks of d(loss_func output / M) with
    M = 1 micro-batch per rank: it must equal the single-process gradient of the full batch."""
    settings = step.LossSettings(**KINDS[name], kl_coef=0.05)
    lp_full, data_full, mask = _data()
    n_seq, n_tok = _counts(mask)
    x = lp_full.clone().requires_grad_(True)
    _loss(settings, x, data_full, n_seq, n_tok)[0].backward()
    want = x.grad.view(mask.shape)
    b = mask.shape[0]
    got = torch.zeros_like(want)
    for r in range(dp):
        rows = slice(r * b // dp, (r + 1) * b // dp)
        lp, data, _ = _data(rows)
        y = lp.clone().requires_grad_(True)
        scaled = compute(settings, y, data, n_seq, n_tok, dp)  # what Megatron back-propagates
        (scaled / dp).backward()  # DDP: gradient_scaling_factor 1 / dp
        got[rows] = y.grad.view(-1, mask.shape[1])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8, msg=f"{name}: DP scaling")


def _scaled(settings, lp, data, n_seq, n_tok, dp):
    """`loss_func`'s factor: loss * M * dp, divided by M by Megatron's schedule (M = 1)."""
    return _loss(settings, lp, data, n_seq, n_tok)[0] * (1 * dp)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_data_parallel_shards_give_the_full_batch_gradient(name):
    check_dp_shards_add_up(_scaled, name)


def test_the_dp_check_catches_a_divisor_dp_squared_too_small():
    def local_mean_then_dp(settings, lp, data, n_seq, n_tok, dp):  # divides by N / dp twice
        return _loss(settings, lp, data, n_seq / dp, n_tok / dp)[0] * dp

    with pytest.raises(AssertionError, match="DP scaling"):
        check_dp_shards_add_up(local_mean_then_dp, "gspo")


def test_loss_func_scales_by_microbatches_times_dp_once():
    """The real `loss_func` on logits: its output is loss x M x dp, for every loss kind."""
    g = torch.Generator().manual_seed(1)
    lp, data, mask = _data()
    S, V = lp.numel(), 11
    logits = torch.randn(1, S, V, generator=g)
    data = dict(data, targets=torch.randint(0, V, (S,), generator=g), local_index=torch.arange(S),
                seq_len=S)
    n_seq, n_tok = _counts(mask)
    ctx = step.ParallelContext(dp_size=2)
    for name in KINDS:
        settings = step.LossSettings(**KINDS[name])
        out, metrics = step.loss_func(data, settings, ctx, n_seq, n_tok, 3, logits)
        assert float(out) == pytest.approx(float(metrics["loss"]) * 3 * 2, rel=1e-6), name


def test_per_token_advantages_are_refused_by_sequence_only_losses():
    lp, data, mask = _data()
    data = dict(data, token_advantages=True)
    for name in ("gspo", "gmpo"):
        with pytest.raises(ValueError, match="per-token advantages"):
            _loss(step.LossSettings(**KINDS[name]), lp, data, *_counts(mask))
    for name in ("gspo_token", "grpo", "sapo", "cispo"):
        _loss(step.LossSettings(**KINDS[name]), lp, data, *_counts(mask))


def test_offpolicy_mask_is_counted_and_keeps_the_divisor():
    lp, data, mask = _data()
    old = data["old_logprobs"].view(mask.shape).clone()
    old[0] += 1.0  # sequence 0 far off-policy (KL = 1 > delta)
    adv = data["seq_advantages"].clone()
    adv[0] = -1.0
    data = dict(data, old_logprobs=old.reshape(-1), seq_advantages=adv,
                advantages=adv[:, None].expand_as(mask).reshape(-1))
    _, st = _loss(step.LossSettings(**KINDS["gspo_offpolicy_mask"]), lp, data, 5.0, 40.0)
    assert float(st["offpolicy_masked_sequences"]) >= 1
    assert float(st["offpolicy_masked_tokens"]) >= mask[0].sum()
    ent_sum = torch.tensor(2.0 * float(mask.sum()))  # entropy 2 on every trainable token
    red = step.reduce_metrics([st | {"loss": torch.tensor(0.0), "entropy_sum": ent_sum}],
                              None, "cpu")
    assert red["entropy"] == pytest.approx(2.0)  # masked tokens stay in the entropy mean
    assert red["offpolicy_masked_share"] == pytest.approx(
        float(st["offpolicy_masked_sequences"]) / 5.0)  # of the 5 rows with trainable tokens
    assert float(st["offpolicy_seen_sequences"]) == 5.0
