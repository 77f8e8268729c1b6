"""Worker for tests/megatron/test_qwen3_5_train.py: `_family_train_worker`'s cases on the tiny
Qwen3.5 dense / MoE models of tests/convert/tiny_qwen3_5.py (three GSPO steps with the embedded
engine and weight sync, r2 / r3 replay on MoE, KL reference; `ref-`: one process's loss and
gradients), and `pe-<arch>`: PP2 / EP2 (MoE) loss and gradients against them."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tests.convert.tiny_families as tiny  # noqa: E402
from tests.convert.tiny_qwen3_5 import DENSE, MOE, make_qwen3_5  # noqa: E402
from tests.megatron import _family_train_worker as family  # noqa: E402

_make = tiny.make_family_model


def _make_family_model(arch, out_dir, seed=0):
    if arch in (DENSE, MOE):
        return make_qwen3_5(out_dir, arch == MOE, seed)
    return _make(arch, out_dir, seed)


tiny.make_family_model = _make_family_model


def case_pipe_expert(arch: str, outdir: Path, chk, info: dict):
    """PP2, TP2 + SP (and, MoE, EP2) give the single process's GSPO loss and gradients (1e-5);
    under SP the packed rows reach the delta-net sequence-sharded (`PackedGatedDeltaNet`
    gathers them)."""
    from megatron_gspo.megatron.parallel import ParallelLayout as PL

    layouts = {"pp2": PL(pipeline=2), "tp2sp": PL(tensor=2, sequence_parallel=True)}
    if arch == MOE:
        layouts["ep2"] = PL(expert=2, expert_tensor=1)
    family.match_reference(arch, outdir, chk, info, layouts)


if __name__ == "__main__":
    kind, arch = sys.argv[1].split("-", 1)
    if kind == "pe":
        family.run_case({sys.argv[1]: lambda outdir, chk, info:
                         case_pipe_expert(arch, outdir, chk, info)})
    else:
        family.main()
