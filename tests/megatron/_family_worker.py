"""Worker processes for the GSPO-family learner test (launched by `_dist.launch`).

Cases:
  fam1 (1 rank)  single-process reference: for SAPO (sequence and per-token advantages),
                 CISPO, GMPO, Dr. GRPO and GSPO with off-policy sequence masking, each with the
                 KL-to-reference and entropy terms on, the loss metrics and full gradients of
                 one forward-backward over the same weights and data.
  fam2 (2 ranks) the same under TP2, PP2 and DP2: loss and gradients equal fam1 to 1e-6
                 (relative norm), the sum-type counters exactly.
Each rank writes `<case>.rank<r>.json` = {"failures": [...], "info": {...}}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.megatron._workers import DENSE, Checker, run_case, make_samples, old_logprobs  # noqa: E402

COMMON = dict(kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)
CASES = {
    "sapo": dict(kind="sapo", tau_pos=1.0, tau_neg=1.05),
    "sapo_tok": dict(kind="sapo", tau_pos=1.0, tau_neg=1.05),
    "cispo": dict(kind="cispo", eps_low=1.0, eps_high=0.03),  # small: some weights truncate
    "gmpo": dict(kind="gmpo", eps_low=0.4, eps_high=0.4),
    "dr_grpo": dict(kind="grpo", eps_low=0.2, eps_high=0.28,
                    grpo_aggregation="seq-mean-token-sum-norm", norm_length=16.0),
    "gspo_offpolicy": dict(kind="gspo", eps_low=3e-4, eps_high=4e-4, offpolicy_mask_delta=1e-3),
}
TOL = 1e-6
SUMS = ("trainable_tokens", "sequences", "clipped_tokens", "offpolicy_masked_sequences")


def _samples(name):
    samples = make_samples()
    if name == "sapo_tok":  # per-token advantages (GSPO-token style)
        for s in samples:
            a = float(s.advantage)
            s.advantage = [a * (1.0 + 0.3 * ((t % 3) - 1)) for t in range(len(s.response_ids))]
    return samples


def _learner(layout=None, seed=7):
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.step import LossSettings

    return Learner(DENSE, layout=layout, optim=OptimSettings(lr=1e-3), seed=seed,
                   loss=LossSettings(**CASES["sapo"], **COMMON),
                   batching=BatchSettings(num_microbatches=2), reference=True)


def _run(L, name, old, ref_lps):
    from megatron_gspo.megatron.step import LossSettings

    L.loss_settings = LossSettings(**CASES[name], **COMMON)
    m = L.forward_backward(_samples(name), old, ref_lps)
    return m, L.full_grads()


def case_fam1(outdir: Path, chk: Checker, info: dict):
    from megatron_gspo.megatron import cpu

    cpu.enable()
    L = _learner()
    full = L.full_state_dict()
    g = torch.Generator().manual_seed(3)
    ref_full = {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)
                for k, v in full.items()}
    L.load_reference(ref_full)
    samples = make_samples()
    lps = L.forward_logprobs(samples)
    old = old_logprobs(lps, scale=5e-2)  # far enough off-policy to clip and mask
    ref_lps = L.forward_logprobs(samples, reference=True)
    out = {}
    for name in CASES:
        m, grads = _run(L, name, old, ref_lps)
        if not (m["kl_loss"] > 0 and m["entropy_loss"] < 0):
            chk.failures.append(f"{name}: KL / entropy terms not active")
        out[name] = (m, grads)
        info[name] = {k: m[k] for k in ("loss", "kl_loss", "clip_fraction",
                                        "offpolicy_masked_share")}
    if not info["gspo_offpolicy"]["offpolicy_masked_share"] > 0:
        chk.failures.append("off-policy masking never fired: the case is vacuous")
    if not info["cispo"]["clip_fraction"] > 0:
        chk.failures.append("CISPO never truncated a weight: the case is vacuous")
    torch.save(dict(full=full, ref_full=ref_full, old=old, ref_lps=ref_lps, out=out),
               outdir / "fam_ref.pt")


def case_fam2(outdir: Path, chk: Checker, info: dict):
    from megatron_gspo.megatron import parallel

    R = torch.load(outdir / "fam_ref.pt", weights_only=False)
    PL = parallel.ParallelLayout
    for tag, layout in (("tp2", PL(tensor=2)), ("pp2", PL(pipeline=2)), ("dp2", PL())):
        L = _learner(layout, seed=99)
        L.load_full_state_dict(R["full"])
        L.load_reference(R["ref_full"])
        for name in CASES:
            m, grads = _run(L, name, R["old"], R["ref_lps"])
            want_m, want_g = R["out"][name]
            for k in ("loss", "kl_loss", "entropy_loss"):
                chk.close(f"{tag}.{name}.{k}", m[k], want_m[k], rtol=TOL, atol=1e-9)
            for k in SUMS:
                if m[k] != want_m[k]:
                    chk.failures.append(f"{tag}.{name}.{k}: {m[k]} != {want_m[k]}")
            chk.dicts(f"{tag}.{name}.grad", grads, want_g, rtol=TOL, atol=1e-9)
        info[tag] = True


def main():
    run_case({"fam1": case_fam1, "fam2": case_fam2})


if __name__ == "__main__":
    main()
