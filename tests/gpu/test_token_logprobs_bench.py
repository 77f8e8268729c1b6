"""bench/token_logprobs.py measures the learner's chunked backward (megatron/tp_logprobs.py's
`vocab_parallel_logprobs`, whose autograd backward recomputes the softmax chunk by chunk), not
only the forward of algo.logprobs; and gpu_kit's summary carries both ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import token_logprobs as bench  # noqa: E402

sys.path.pop(0)


def test_learner_method_runs_the_chunked_backward(monkeypatch):
    from megatron_gspo.megatron import tp_logprobs as logprobs

    calls = []
    real = logprobs._VocabParallelLogProbs.backward

    def counting(ctx, *grads):
        calls.append(1)
        return real(ctx, *grads)

    monkeypatch.setattr(logprobs._VocabParallelLogProbs, "backward", staticmethod(counting))
    got = bench._child(64, 100, "float32", "learner", 2)
    assert len(calls) == 2 and got["time_s"] > 0 and got["logits_bytes"] == 64 * 100 * 4
    bench._child(64, 100, "float32", "learner_materialised", 1)  # the reference: no chunks
    bench._child(64, 100, "float32", "chunked", 1)  # forward only
    assert len(calls) == 2


def test_rows_and_summary_carry_the_learner_ratios(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "token_logprobs.py"), "--cases",
                        "128x500:float32", "--repeats", "1", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stderr[-2000:]
    [row] = json.loads(out.read_text())["rows"]
    for k in ("ratio_memory", "ratio_time", "learner_ratio_memory", "learner_ratio_time",
              "learner_extra_gib", "learner_materialised_extra_gib"):
        assert row[k] > 0, k
    assert "fwd+bwd" in r.stdout
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_kit
    finally:
        sys.path.pop(0)
    (tmp_path / "bench_logprobs.json").write_text(out.read_text())
    assert "learner fwd+bwd" in gpu_kit.stage_numbers("bench_logprobs", tmp_path)
