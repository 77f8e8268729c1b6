"""Clip fraction split by cause: on the first mini-batch the learner's weights equal pi_old's, so
only engine/learner mismatch clips there; later mini-batches add policy drift."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.loop.phases import clip_split, minibatch_parts

WORKER = Path(__file__).with_name("_clip_split_worker.py")


def _mb(clipped, tokens, lo=1.0, hi=1.0):
    return {"clipped_tokens": float(clipped), "trainable_tokens": float(tokens),
            "ratio_min": lo, "ratio_max": hi}


def test_split_is_token_weighted_per_cause():
    m = clip_split([_mb(3, 10, 0.99, 1.01), _mb(0, 30, 0.9, 1.0), _mb(10, 10, 1.0, 1.3)])
    assert m["clip_fraction/first_minibatch"] == pytest.approx(0.3)
    assert m["clip_fraction/later_minibatches"] == pytest.approx(10 / 40)  # not mean(0, 1)
    assert [m[f"clip_fraction/minibatch_{i}"] for i in range(3)] == pytest.approx([0.3, 0, 1])
    assert m["ratio/spread"] == pytest.approx(0.4)
    one = clip_split([_mb(1, 4)])
    assert "clip_fraction/later_minibatches" not in one and one[
        "clip_fraction/first_minibatch"] == 0.25
    assert clip_split([_mb(0, 0)])["clip_fraction/first_minibatch"] == 0.0  # no NaN


def test_minibatch_parts_cover_the_batch_once():
    parts = minibatch_parts(10, 3, seed=1, step=4)
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert [len(p) for p in parts] == [3, 3, 4]
    assert parts == minibatch_parts(10, 3, seed=1, step=4)
    assert parts != minibatch_parts(10, 3, seed=1, step=5)


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=str(WORKER.parents[2]))
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
def test_first_minibatch_clips_exactly_the_mismatched_sequences(result, kind):
    r = result[f"{kind}/rollout"]
    assert 0 < r["expected_first"] < 1
    assert r["first"] == pytest.approx(r["expected_first"], abs=1e-9)
    assert r["mb"][0] == r["first"] and r["mb"][1] == r["later"]


@pytest.mark.slow
def test_later_minibatches_add_drift_at_gspo_clip_range_not_grpo(result):
    gspo, grpo = result["gspo/rollout"], result["grpo/rollout"]
    # GSPO's 4e-4 range: one update moves other sequences' ratios out of range too.
    assert gspo["later"] > gspo["expected_later_from_mismatch"] + 0.05
    # GRPO's 0.28 range: one small update clips nothing new; only the shifted tokens clip.
    assert grpo["later"] == pytest.approx(grpo["expected_later_from_mismatch"], abs=1e-9)


@pytest.mark.slow
def test_recomputed_pi_old_leaves_no_first_minibatch_clipping(result):
    r = result["gspo/recompute"]  # same shifted engine log-probs, but pi_old is the learner's
    assert r["first"] == 0.0 and r["later"] > 0.0
