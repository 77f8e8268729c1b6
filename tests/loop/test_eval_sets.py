"""Evaluation with `train.eval_samples` responses per prompt: mean@n and the unbiased pass@k
estimator, several named eval sets (`data.eval_sets`), failed responses left out, and the
metrics of a tiny CLI run."""

import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_gspo.loop import build, phases
from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.data.datasets import PromptItem
from megatron_gspo.loop.evaluation import default_ks, pass_at_k, set_metrics
from megatron_gspo.rollout.engine import RolloutEngine, SamplingParams, make_sample

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"


def _exact(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("n,c,k,want", [
    (1, 0, 1, 0.0), (1, 1, 1, 1.0),
    (2, 1, 1, 0.5),
    (4, 1, 2, 0.5),          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),          # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (8, 3, 1, 3 / 8),        # pass@1 = c/n
    (8, 0, 8, 0.0),
    (8, 6, 3, 1.0),          # n - c < k: every draw of 3 holds a correct one
    (10, 2, 4, 1 - 70 / 210),  # C(8,4) = 70, C(10,4) = 210
])
def test_pass_at_k_on_hand_made_cases(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(float(_exact(n, c, k)), abs=1e-12)


def test_pass_at_k_is_stable_where_the_binomials_overflow_floats():
    n, c, k = 2000, 7, 300  # C(2000, 300) ~ 1e363 is beyond float range
    with pytest.raises(OverflowError):
        float(math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(_exact(n, c, k)), rel=1e-12)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_set_metrics_mean_at_n_and_pass_at_k():
    rewards = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0.5, 1, 1, 1]]
    m = set_metrics(rewards, 4, [1, 2, 4], threshold=1.0)
    assert m["mean@4"] == pytest.approx((0.25 + 0.5 + 0 + 0.875) / 4)
    assert m["pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0 + 3 / 4) / 4)
    want2 = (float(_exact(4, 1, 2)) + float(_exact(4, 2, 2)) + 0 + 1) / 4
    assert m["pass@2"] == pytest.approx(want2)
    assert m["pass@4"] == pytest.approx(3 / 4)
    # a prompt with fewer usable responses than k is left out of that pass@k only
    m = set_metrics([[1, 0, 0, 0], [1, 0]], 4, [1, 4], threshold=1.0)
    assert m["pass@1"] == pytest.approx((0.25 + 0.5) / 2) and m["pass@4"] == 1.0
    m = set_metrics([[1, 0], [], [0]], 4, [1, 4], threshold=1.0)
    assert set(m) == {"mean@4", "pass@1"}  # no prompt has 4 usable responses
    assert set_metrics([[], []], 4, [1], threshold=1.0) == {}
    assert default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6]
    assert default_ks(1) == [1]


class CountingEngine(RolloutEngine):
    """n responses per request: response j of a prompt is its answer when j < correct[row],
    else a wrong one; the row named in `fail_row` has its first response failed."""

    def __init__(self, tok, answers, correct, fail_row=None):
        super().__init__(SamplingParams(max_new_tokens=8))
        self.tok, self.answers, self.correct, self.fail_row = tok, answers, correct, fail_row
        self.seen = []

    @property
    def weight_version(self):
        return 0

    async def agenerate(self, requests):
        out = []
        for r, req in enumerate(requests):
            sp = req.sampling
            self.seen.append((req.metadata["row"], sp.n, sp.temperature))
            row = req.metadata["row"]
            for j in range(sp.n):
                text = self.answers[row] if j < self.correct[row] else "99"
                ids = self.tok.encode(text + "<|im_end|>", add_special_tokens=False)
                extra = {"rollout_error": "aborted"} if (row == self.fail_row and j == 0) else {}
                out.append(make_sample(req, r, len(out), ids, [-0.1] * len(ids), "stop", 0,
                                       extra))
        return out

    async def aupdate_weights(self, buckets, version):
        raise NotImplementedError

    async def ahealth(self):
        return True


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "examples" / "tiny" / "base")


def test_named_sets_report_mean_at_n_and_pass_at_k(tok):
    cfg = load_config(CONFIG, ["train.eval_samples=4", "train.eval_temperature=0.8",
                               "train.eval_pass_k=[1,2]"])
    answers = {0: "46", 1: "12", 2: "7"}
    engine = CountingEngine(tok, answers, correct={0: 4, 1: 1, 2: 0}, fail_row=1)
    items = [PromptItem(prompt_ids=[5 + i], prompt=f"p{i}", label=answers[i], row=i)
             for i in range(3)]
    sets = {"": items[:1], "hard": items[1:]}
    m = phases.evaluate(cfg, engine, tok, build.reward_scorer(cfg, tok), sets)
    assert sorted(engine.seen) == [(0, 4, 0.8), (1, 4, 0.8), (2, 4, 0.8)]
    assert m["eval/mean@4"] == 1.0 and m["eval/pass@1"] == 1.0 and m["eval/pass@2"] == 1.0
    assert m["eval/prompts"] == 1.0 and "eval/samples_failed" not in m
    # set "hard": row 1 keeps 3 usable responses (the failed one was its correct one), 0 right
    assert m["eval/hard/samples_failed"] == 1.0
    assert m["eval/hard/mean@4"] == 0.0 and m["eval/hard/pass@2"] == 0.0
    assert m["eval/hard/prompts"] == 2.0
    assert not any(k.startswith("eval/hard/pass@4") for k in m)


def test_eval_config_errors():
    with pytest.raises(ConfigError, match="train.eval_samples: .*eval_temperature > 0"):
        load_config(CONFIG, ["train.eval_samples=4", "train.eval_temperature=0"])
    with pytest.raises(ConfigError, match=r"train.eval_pass_k: 8 is outside \[1, "):
        load_config(CONFIG, ["train.eval_samples=4", "train.eval_pass_k=[1,8]"])
    with pytest.raises(ConfigError, match="data.eval_sets: set name 'a/b'"):
        load_config(CONFIG, ["data.eval_sets={a/b: x.jsonl}"])


def test_eval_sets_appear_in_metrics_jsonl_of_a_tiny_run(random_tiny_model, tmp_path):
    data = ROOT / "examples" / "tiny" / "data"
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir", str(run),
           f"model.path={random_tiny_model}", "train.max_steps=1", "train.prompts_per_step=2",
           "rollout.group_size=2", "rollout.max_new_tokens=4", "algorithm.mini_batches=1",
           "logging.progress_bar=false", "logging.tensorboard=false", "logging.log_samples=0",
           "train.eval_interval=1", "train.eval_prompts=3", "train.eval_samples=4",
           "train.eval_temperature=1.0",
           f"data.eval_sets={{easy: {data / 'eval.jsonl'}, drill: {data / 'train.jsonl'}}}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    row = rows[-1]
    for prefix in ("eval", "eval/easy", "eval/drill"):
        for key in ("mean@4", "pass@1", "pass@2", "pass@4", "reward_mean"):
            assert 0.0 <= row[f"{prefix}/{key}"] <= 1.0, (prefix, key)
        assert row[f"{prefix}/prompts"] == 3.0
        assert row[f"{prefix}/pass@1"] <= row[f"{prefix}/pass@2"] <= row[f"{prefix}/pass@4"]
        assert row[f"{prefix}/pass@1"] == pytest.approx(row[f"{prefix}/mean@4"])  # 0/1 rewards
