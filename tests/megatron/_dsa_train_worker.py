"""Worker for tests/megatron/test_dsa_train.py (launched by `_dist.launch`): the cases of
`_family_train_worker.py` on the tiny DeepSeek Sparse Attention models of tests/convert/tiny_dsa.py
(`train-<arch>`: three GSPO steps with the embedded engine, weight sync, routing replay;
`ref-<arch>`: one process's GSPO loss and gradients), and `par-<arch>`: the learner under PP2 and
EP2 gives them to 1e-5 (TP is refused for DSA). Writes `<case>.rank<r>.json` like that worker."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.convert import tiny_dsa, tiny_families  # noqa: E402
from tests.megatron import _family_train_worker  # noqa: E402


def case_par(arch: str, outdir: Path, chk, info: dict):
    """PP2 and EP2 give the single process's GSPO loss and gradients (1e-5)."""
    import torch

    from megatron_gspo.megatron.parallel import ParallelLayout as PL

    ref = torch.load(outdir / "ref_grads.pt")
    for tag, layout in {"pp2": PL(pipeline=2), "ep2": PL(expert=2, expert_tensor=1)}.items():
        m, g = _family_train_worker._grads_run(arch, outdir, layout)
        chk.close(f"{tag}.loss", m["loss"], ref["loss"], rtol=1e-5, atol=1e-8)
        chk.dicts(f"{tag}.grad", g, ref["grads"], rtol=1e-5, atol=1e-8)
        info[tag] = float(m["loss"])
        info[f"{tag}_grad_max_abs"] = max(float((g[k] - ref["grads"][k]).abs().max())
                                          for k in ref["grads"])


if __name__ == "__main__":
    # the family worker builds its model with tiny_families.make_family_model at call time
    tiny_families.make_family_model = tiny_dsa.make_dsa_model
    _family_train_worker.case_par = case_par
    _family_train_worker.main()
