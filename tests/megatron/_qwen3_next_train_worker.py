"""Worker for tests/megatron/test_qwen3_next_train.py: `_family_train_worker`'s cases on the
tiny Qwen3-Next of tests/convert/tiny_qwen3_next.py (three GSPO steps with the embedded engine
and weight sync, r2 / r3 replay, KL reference)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tests.convert.tiny_families as tiny  # noqa: E402
from tests.convert.tiny_qwen3_next import ARCH, make_qwen3_next  # noqa: E402
from tests.megatron import _family_train_worker as family  # noqa: E402

_make = tiny.make_family_model


def _make_family_model(arch, out_dir, seed=0):
    return make_qwen3_next(out_dir, seed) if arch == ARCH else _make(arch, out_dir, seed)


tiny.make_family_model = _make_family_model

if __name__ == "__main__":
    family.main()
