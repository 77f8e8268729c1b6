"""Optional tier: our weight payloads against SGLang 0.5.12's own classes (serializer,
SafeUnpickler, FlattenedTensorBucket, CUDA reduction patch). Needs the pieces installed by
scripts/sglang_pieces.sh (folder MEGATRON_GSPO_SGLANG_PIECES, default .sglang-pieces); skipped
without them. Runs in a subprocess so sglang's global patches stay out of this process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIECES = Path(os.environ.get("MEGATRON_GSPO_SGLANG_PIECES", ROOT / ".sglang-pieces"))
WORKER = Path(__file__).with_name("_sglang_pieces_worker.py")

pytestmark = pytest.mark.skipif(not (PIECES / "sglang").is_dir(),
                                reason=f"no SGLang pieces in {PIECES} (scripts/sglang_pieces.sh)")


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(PIECES)]))
    out = subprocess.run([sys.executable, str(WORKER)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])


def test_sglang_decodes_our_payloads_and_we_decode_its(result):
    assert result["sglang_importable"]
    assert result["metadata_module"] == "sglang.srt.weight_sync.tensor_bucket"
    assert result["sglang_decodes_ours"] and result["standin_decodes_sglang"]
    # Without sglang the learner's records are SimpleNamespace, which SafeUnpickler accepts.
    assert result["fallback_metadata_module"] == "types" and result["sglang_decodes_fallback"]


def test_sglang_patch_breaks_plain_cpu_pickling_but_not_ours(result):
    assert result["plain_cpu_dump_after_patch"] == "IndexError"
    assert result["sglang_decodes_ours"]  # made after the patch


def test_stand_in_allow_list_agrees_with_safe_unpickler(result):
    verdicts = result["allow_list"]
    assert all(sgl == ours for sgl, ours in verdicts.values()), verdicts
    assert verdicts["OldMeta"] == [False, False] and verdicts["PurePosixPath"] == [False, False]
    assert verdicts["SimpleNamespace"] == [True, True]
