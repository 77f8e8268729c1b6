"""Worker processes for the KL / entropy learner tests (launched by `_dist.launch`).

Cases:
  kl1 (1 rank)  single-process reference with KL (k3, in the loss) and the entropy bonus on; the
                reference stays bit-identical over 5 optimizer steps; kl_coef 0 builds no
                reference model; differentiable entropy vs float64 autograd.
  kl2 (2 ranks) TP2 and PP2 layouts with the same weights and data give kl1's loss, KL part and
                gradients; the vocab-parallel entropy (value and gradient) under TP2.
  Both cases: the policy + reference log-probs of one pipeline schedule
  (`forward_logprobs_with_reference`) equal the two separate passes (bit-identical in the same
  layout, 1e-6 against the single process; also TP2+SP and PP2 with VPP2).
Each rank writes `<case>.rank<r>.json` = {"failures": [...], "info": {...}}.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.megatron._workers import DENSE, Checker, run_case, make_samples, old_logprobs  # noqa: E402

SETTINGS = dict(kind="gspo", eps_low=3e-4, eps_high=4e-4, kl_coef=0.05, kl_estimator="k3",
                entropy_coef=0.01)


def _perturbed(full: dict, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)
            for k, v in full.items()}


def _learner(layout=None, *, kl=True, seed=7):
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.step import LossSettings

    loss = LossSettings(**SETTINGS) if kl else LossSettings()
    return Learner(DENSE, layout=layout, optim=OptimSettings(lr=1e-3), seed=seed, loss=loss,
                   batching=BatchSettings(num_microbatches=2), reference=kl)


def _entropy_check(chk: Checker, group, rank: int, size: int, tag: str):
    from megatron_gspo.megatron.tp_logprobs import vocab_parallel_entropy

    g = torch.Generator().manual_seed(5)
    full = torch.randn(13, 128, generator=g, dtype=torch.float64) * 2
    up = torch.randn(13, generator=g, dtype=torch.float64)
    x = full[:, :100].clone().requires_grad_(True)
    p = torch.softmax(x / 0.7, -1)
    ent_ref = -(p * torch.log_softmax(x / 0.7, -1)).sum(-1)  # [13] float64
    (ent_ref * up).sum().backward()
    width = 128 // size
    mine = full[:, rank * width:(rank + 1) * width].float().clone().requires_grad_(True)
    ent = vocab_parallel_entropy(mine, temperature=0.7, vocab_start=rank * width,
                                 vocab_size=100, group=group, chunk_size=4)
    (ent * up.float()).sum().backward()
    chk.close(f"{tag} entropy value", ent, ent_ref, rtol=1e-6)
    ref_grad = torch.cat([x.grad, torch.zeros(13, 28, dtype=torch.float64)], dim=1)
    chk.close(f"{tag} entropy grad", mine.grad, ref_grad[:, rank * width:(rank + 1) * width],
              rtol=1e-5)


def _paired_check(chk: Checker, L, samples, lps, ref_lps, tag: str, exact: bool) -> int:
    """The one-schedule policy + reference pass gives the two separate passes' values; returns
    how many pipeline schedules it ran."""
    runs = []
    run = L._run
    L._run = lambda *a, **k: (runs.append(1), run(*a, **k))[1]
    try:
        got, got_ref = L.forward_logprobs_with_reference(samples)
    finally:
        L._run = run
    if len(runs) != 1:
        chk.failures.append(f"{tag}: paired pass ran {len(runs)} schedules, expected 1")
    if exact:
        if got != lps or got_ref != ref_lps:
            chk.failures.append(f"{tag}: paired log-probs are not bit-identical to two passes")
    else:
        chk.close(f"{tag} paired policy", [x for y in got for x in y],
                  [x for y in lps for x in y], rtol=1e-6)
        chk.close(f"{tag} paired reference", [x for y in got_ref for x in y],
                  [x for y in ref_lps for x in y], rtol=1e-6)
    return len(runs)


def case_kl1(outdir: Path, chk: Checker, info: dict):
    from megatron.core.models.gpt import GPTModel

    from megatron_gspo.megatron import cpu

    cpu.enable()
    samples = make_samples()
    L = _learner()
    full = L.full_state_dict()
    ref_full = _perturbed(full)
    L.load_reference(ref_full)
    lps = L.forward_logprobs(samples)
    old = old_logprobs(lps)
    ref_lps = L.forward_logprobs(samples, reference=True)
    info["paired_schedules"] = _paired_check(chk, L, samples, lps, ref_lps, "single", True)
    m = L.forward_backward(samples, old, ref_lps)
    grads = L.full_grads()
    info["kl_loss"], info["loss"], info["entropy"] = m["kl_loss"], m["loss"], m["entropy"]
    if not m["kl_loss"] > 0 or not m["entropy_loss"] < 0:
        chk.failures.append(f"kl/entropy parts not active: {m['kl_loss']}, {m['entropy_loss']}")
    # the KL part equals the pure-torch formula on the same log-probs
    from megatron_gspo.algo import kl as klmod
    from megatron_gspo.data.batch import pad_rows as _padded

    mask = _padded([list(map(float, s.loss_mask)) for s in samples])
    want = klmod.kl_loss(_padded(lps), _padded(ref_lps), mask, coef=0.05, estimator="k3")
    chk.close("kl part vs algo.kl", m["kl_loss"], float(want), rtol=1e-5)
    torch.save(dict(full=full, ref_full=ref_full, old=old, ref_lps=ref_lps, metrics=m,
                    grads=grads, lps=lps), outdir / "kl_ref.pt")
    # frozen: bit-identical over 5 optimizer steps while the policy moves
    before = {k: v.clone() for m_ in L.reference_chunks for k, v in m_.state_dict().items()
              if isinstance(v, torch.Tensor)}
    for _ in range(5):
        L.train_step(samples, old, L.forward_logprobs(samples, reference=True))
    after = {k: v for m_ in L.reference_chunks for k, v in m_.state_dict().items()
             if isinstance(v, torch.Tensor)}
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    if changed:
        chk.failures.append(f"reference changed over 5 steps: {changed[:4]}")
    if any(p.grad is not None or p.requires_grad for m_ in L.reference_chunks
           for p in m_.parameters()):
        chk.failures.append("reference parameters require or hold gradients")
    moved = max((L.full_state_dict()[k] - full[k]).abs().max().item() for k in full)
    info["policy_moved"] = moved
    if not moved > 0:
        chk.failures.append("the policy did not move in 5 steps (reference check is vacuous)")
    # kl_coef = 0: no reference model at all
    L0 = _learner(kl=False, seed=8)
    n_models = sum(isinstance(o, GPTModel) for o in gc.get_objects())
    info["gpt_models_alive"] = n_models
    if L0.reference_chunks is not None or L0.reference_bytes() != 0:
        chk.failures.append("kl_coef 0 built a reference")
    if n_models != len(L.chunks) * 2 + len(L0.chunks):  # L: policy + reference; L0: policy
        chk.failures.append(f"{n_models} GPTModels alive, expected {len(L.chunks) * 2 + 1}")
    try:
        L0.forward_logprobs(samples, reference=True)
        chk.failures.append("reference forward without a reference did not raise")
    except ValueError:
        pass
    _entropy_check(chk, None, 0, 1, "single")


def case_kl2(outdir: Path, chk: Checker, info: dict):
    from megatron.core import parallel_state as ps

    from megatron_gspo.megatron import parallel

    R = torch.load(outdir / "kl_ref.pt", weights_only=False)
    samples = make_samples()
    PL = parallel.ParallelLayout
    for name, layout in (("tp2", PL(tensor=2)), ("pp2", PL(pipeline=2))):
        L = _learner(layout, seed=99)
        L.load_full_state_dict(R["full"])
        L.load_reference(R["ref_full"])
        ref_lps = L.forward_logprobs(samples, reference=True)
        chk.close(f"{name}.ref_logprobs", [x for y in ref_lps for x in y],
                  [x for y in R["ref_lps"] for x in y], rtol=1e-6)
        # one schedule for both models: the same values as this layout's two passes (bits)
        # and as the single process (1e-6)
        _paired_check(chk, L, samples, L.forward_logprobs(samples), ref_lps, name, True)
        _paired_check(chk, L, samples, R["lps"], R["ref_lps"], f"{name} vs single", False)
        m = L.forward_backward(samples, R["old"], R["ref_lps"])
        for k in ("loss", "kl_loss", "entropy_loss", "entropy"):
            chk.close(f"{name}.{k}", m[k], R["metrics"][k])
        chk.dicts(f"{name}.grad", L.full_grads(), R["grads"])
        info[name] = m["loss"]
        if name == "tp2":
            _entropy_check(chk, ps.get_tensor_model_parallel_group(),
                           ps.get_tensor_model_parallel_rank(), 2, "tp2")
    # the paired pass under sequence parallelism and the interleaved pipeline schedule
    for name, layout in (("tp2sp", PL(tensor=2, sequence_parallel=True)),
                         ("pp2vpp2", PL(pipeline=2, virtual_pipeline=2))):
        L = _learner(layout, seed=99)
        L.load_full_state_dict(R["full"])
        L.load_reference(R["ref_full"])
        _paired_check(chk, L, samples, R["lps"], R["ref_lps"], f"{name} vs single", False)
        info[name] = True


def main():
    run_case({"kl1": case_kl1, "kl2": case_kl2})


if __name__ == "__main__":
    main()
