"""Worker for tests/megatron/test_mla_tensor_parallel.py (one rank, launched by `_dist.launch`).

Multi-latent attention (tiny DeepSeek-V3 of tests/convert/tiny_families.py) under tensor
parallelism: the GSPO loss and full gradients of one forward-backward (the learner, DDP and
`finalize_model_grads`) against one process's, for
  - `tp2_sp`: TP2 + sequence parallel with the down projections replicated (the spec the
    learner builds; required within 1e-5);
  - `tp2_sp_column`: the same with Megatron-Core's local spec as it is (column-parallel down
    projections whose output MLA gathers over TP): what the learner built before (measured);
  - `tp2_sp_dense`: TP2 + SP on the same model with every layer dense (required within 1e-5);
  - `tp2_dense`, `tp2_dense_column`: TP2 without sequence parallelism, both specs, on the dense
    model (Megatron-Core's MoE layer refuses TP without SP in training); measured only: the
    learner refuses MLA under TP without SP.
The layout checks are bypassed for the measured cases. Writes `<case>.rank<R>.json`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.megatron._family_train_worker import _grads_run  # noqa: E402
from tests.megatron._workers import Checker, run_case  # noqa: E402

ARCH = "DeepseekV3ForCausalLM"
TOL = 1e-5


def case_ref(outdir: Path, chk: Checker, info: dict):
    """One process's loss and gradients of the tiny DeepSeek-V3 (`moe/`) and of the same model
    with every layer dense (`dense/`: MoE layers refuse TP without SP upstream)."""
    from tests.convert import tiny_families as tf

    cls, fields = tf.FAMILIES[ARCH]
    for sub, extra in (("moe", {}), ("dense", {"first_k_dense_replace":
                                              fields["num_hidden_layers"]})):
        tf.FAMILIES[ARCH] = (cls, {**fields, **extra})
        try:
            tf.make_family_model(ARCH, outdir / sub / "hf")
        finally:
            tf.FAMILIES[ARCH] = (cls, fields)
        keep: list = []
        m, g = _grads_run(ARCH, outdir / sub, None, keep)
        info[sub] = m["loss"]
        torch.save({"loss": m["loss"], "grads": g, **_step(keep[0])},
                   outdir / sub / "ref_grads.pt")


def _step(learner) -> dict:
    """Grad norm of one optimizer step and the down projections' weights after it (this rank's
    copies: replicated weights must stay equal on every TP rank)."""
    norm = learner.optimizer_step()["grad_norm"]
    after = {n: p.detach().clone() for n, p in learner.chunks[0].named_parameters()
             if n.endswith(("down_proj.weight",)) and "self_attention" in n}
    return {"grad_norm": norm, "after": after}


def _diff(got: dict, ref: dict) -> dict:
    rel = {k: float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30))
           for k in ref}
    worst = max(ref, key=lambda k: float((got[k] - ref[k]).abs().max()))
    return {"grad_max_abs": float((got[worst] - ref[worst]).abs().max()), "worst": worst,
            "grad_max_rel": max(rel.values()), "worst_rel": max(rel, key=rel.get)}


def _run(outdir: Path, layout, column: bool) -> tuple[dict, dict, dict]:
    """One TP run (forward-backward, then an optimizer step) with the checks that would refuse
    it bypassed (`column`: the down projections as Megatron-Core's local spec builds them)."""
    from megatron_gspo.megatron import parallel
    from megatron_gspo.megatron.models import deepseek_v3

    saved = (deepseek_v3.check_training_layout, deepseek_v3.replicated_down_projections,
             parallel._model_errors)
    keep: list = []
    deepseek_v3.check_training_layout = lambda *a, **k: None
    parallel._model_errors = lambda lay, hf: [e for e in saved[2](lay, hf)
                                              if "sequence_parallel" not in e]
    if column:
        deepseek_v3.replicated_down_projections = lambda spec: spec
    try:
        m, g = _grads_run(ARCH, outdir, layout, keep)
        return m, g, _step(keep[0])
    finally:
        (deepseek_v3.check_training_layout, deepseek_v3.replicated_down_projections,
         parallel._model_errors) = saved


def case_tp2(outdir: Path, chk: Checker, info: dict):
    from megatron_gspo.megatron.compat import version
    from megatron_gspo.megatron.parallel import ParallelLayout as PL

    info["megatron_core"] = ".".join(map(str, version()))

    for tag, sub, sp, column in (("tp2_sp", "moe", True, False),
                                 ("tp2_sp_column", "moe", True, True),
                                 ("tp2_sp_dense", "dense", True, False),
                                 ("tp2_dense", "dense", False, False),
                                 ("tp2_dense_column", "dense", False, True)):
        ref = torch.load(outdir / sub / "ref_grads.pt")
        try:
            m, g, st = _run(outdir / sub, PL(tensor=2, sequence_parallel=sp), column)
        except Exception as e:  # noqa: BLE001 - a measured case may fail upstream: say how
            info[tag] = {"error": f"{type(e).__name__}: {e}"[:300]}
            if tag == "tp2_sp":
                raise
            continue
        info[tag] = {"loss_diff": abs(m["loss"] - ref["loss"]), **_diff(g, ref["grads"])}
        info[tag]["grad_norm_diff"] = abs(st["grad_norm"] - ref["grad_norm"])
        if sp and not column:
            chk.close(f"{tag}.loss", m["loss"], ref["loss"], rtol=1e-6, atol=1e-8)
            chk.close(f"{tag}.grad_norm", st["grad_norm"], ref["grad_norm"], rtol=1e-6)
            # this rank's replicated down projections after the step: one process's weights
            chk.dicts(f"{tag}.stepped", st["after"], ref["after"], rtol=1e-5, atol=1e-8)
            if not info[tag]["grad_max_abs"] <= TOL:
                chk.failures.append(f"{tag}: gradients off one process's: {info[tag]}")
    print(info, flush=True)


def case_tp2ep2(outdir: Path, chk: Checker, info: dict):
    """4 ranks: TP2 + SP with EP2 (expert-TP 1) and DP2, the layout DeepSeek-V3 runs in."""
    from megatron_gspo.megatron.parallel import ParallelLayout as PL

    ref = torch.load(outdir / "moe" / "ref_grads.pt")
    m, g, st = _run(outdir / "moe", PL(tensor=2, sequence_parallel=True, expert=2,
                                       expert_tensor=1), False)
    info["tp2_sp_ep2_dp2"] = {"loss_diff": abs(m["loss"] - ref["loss"]), **_diff(g, ref["grads"]),
                              "grad_norm_diff": abs(st["grad_norm"] - ref["grad_norm"])}
    chk.close("loss", m["loss"], ref["loss"], rtol=1e-6, atol=1e-8)
    chk.close("grad_norm", st["grad_norm"], ref["grad_norm"], rtol=1e-6)
    chk.dicts("stepped", st["after"], ref["after"], rtol=1e-5, atol=1e-8)
    if not info["tp2_sp_ep2_dp2"]["grad_max_abs"] <= TOL:
        chk.failures.append(f"TP2+SP+EP2: gradients off one process's: {info}")
    print(info, flush=True)


def main():
    run_case({"ref": case_ref, "tp2": case_tp2, "tp2ep2": case_tp2ep2})


if __name__ == "__main__":
    main()
