"""The precision sweep (bench/precision_sweep.py): its measurement on identical and on real
engine log-probs (the embedded engine in float32 and bfloat16 against a float32 recompute), the
1/sqrt(L) expectation, the safe length, and (slow) the whole command with the Megatron learner."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.data.batch import pad_rows as padded
from bench.precision_sweep import (
    expected_safe_length,
    expected_share,
    measure,
    safe_length,
    truncate,
)

ROOT = Path(__file__).resolve().parents[2]
GSPO, GRPO = (3e-4, 4e-4), (0.2, 0.28)


def _measure(learner, engine, mask, tolerance=0.05):
    return measure(learner, engine, mask, gspo_clip=GSPO, grpo_clip=GRPO, tolerance=tolerance)


def test_identical_logprobs_give_zero_mismatch_and_reuse():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(6, 10, generator=g) * 3
    mask = torch.ones(6, 10)
    mask[0, 5:] = 0
    p = _measure(lp, lp.clone(), mask)
    assert p["token_abs_diff_mean"] == 0 and p["seq_mismatch_std"] == 0
    assert p["gspo_seq_out"] == 0 and p["grpo_token_out"] == 0
    assert p["auto_gspo"] == "rollout" and p["auto_grpo"] == "rollout"


def test_a_shifted_sequence_is_out_of_gspo_range_and_auto_recomputes():
    lp = -torch.ones(4, 8)
    engine = lp.clone()
    engine[0] -= 1e-3  # d_0 = +1e-3 > log(1 + 4e-4): one sequence of 4 out of range
    p = _measure(lp, engine, torch.ones(4, 8), tolerance=0.05)
    assert p["gspo_seq_out"] == 0.25 and p["auto_gspo"] == "recompute"
    assert p["grpo_token_out"] == 0 and p["auto_grpo"] == "rollout"
    assert _measure(lp, engine, torch.ones(4, 8), tolerance=0.3)["auto_gspo"] == "rollout"


def _random_model_dir(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2,
                      pad_token_id=3)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # peaked logits, like a trained model's
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(tmp_path)
    return model.eval()


def test_real_engine_fp32_matches_and_bf16_mismatch_shrinks_with_length(tmp_path):
    from megatron_gspo.algo.logprobs import token_logprobs
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    learner = _random_model_dir(tmp_path)
    sp = SamplingParams(max_new_tokens=48, temperature=1.0, n=4, ignore_eos=True)
    prompts = [[5 + i, 9, 17 + i, 30] for i in range(4)]
    res = {}
    for dtype in ("float32", "bfloat16"):
        eng = EmbeddedEngine(str(tmp_path), dtype=dtype, seed=1)
        samples = eng.generate([GenerateRequest(prompt_ids=p, sampling=sp) for p in prompts])
        eng.shutdown()
        assert all(len(s.response_ids) == 48 for s in samples)
        for length in (4, 48):
            cut = truncate(samples, length)
            assert all(len(s.response_ids) == len(s.rollout_logprobs) == length for s in cut)
            with torch.no_grad():  # the float32 recompute of every cut response
                lps = []
                for s in cut:
                    ids = torch.tensor([s.prompt_ids + s.response_ids])
                    logits = learner(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
                    lps.append(token_logprobs(logits, torch.tensor(s.response_ids)).tolist())
            res[dtype, length] = _measure(padded(lps), padded([s.rollout_logprobs for s in cut]),
                                          padded([list(map(float, s.loss_mask)) for s in cut]))
    for length in (4, 48):
        fp = res["float32", length]
        assert fp["token_abs_diff_max"] < 1e-4 and fp["gspo_seq_out"] == 0
        assert fp["auto_gspo"] == "rollout"
        assert res["bfloat16", length]["token_abs_diff_mean"] > 1e-3
    bf4, bf48 = res["bfloat16", 4], res["bfloat16", 48]
    assert bf48["seq_mismatch_std"] < 0.6 * bf4["seq_mismatch_std"]  # ~1/sqrt(12) = 0.29


def test_expected_share_shrinks_as_one_over_sqrt_length():
    share = [expected_share(0.0, 0.02, L, GSPO) for L in (1, 16, 256, 4096, 65536)]
    assert all(a > b for a, b in zip(share, share[1:], strict=False))
    # d ~ N(0, sigma^2 / L) with a symmetric band +-e: share = 2 * Phi(-e sqrt(L) / sigma)
    e, sigma, L = 5e-4, 0.02, 10_000
    want = 2 * 0.5 * (1 + math.erf(-e * math.sqrt(L) / sigma / math.sqrt(2)))
    assert expected_share(0.0, sigma, L, (e / (1 + e), math.expm1(math.log1p(e)))) == \
        pytest.approx(want, rel=0.02)
    n = expected_safe_length(0.0, 0.02, GSPO, 0.05)
    assert expected_share(0.0, 0.02, n, GSPO) <= 0.05 < expected_share(0.0, 0.02, n - 1, GSPO)
    assert expected_safe_length(1e-3, 0.02, GSPO, 0.05) is None  # the mean is out of the band
    assert expected_safe_length(0.0, 0.0, GSPO, 0.05) == 1


def test_safe_length_is_where_reuse_holds_for_every_longer_length():
    dec = {4: "recompute", 8: "rollout", 16: "recompute", 32: "rollout", 64: "rollout"}
    pts = [{"length": k, "auto_gspo": v} for k, v in dec.items()]
    assert safe_length(pts) == 32
    pts[-1]["auto_gspo"] = "recompute"
    assert safe_length(pts) is None


@pytest.mark.slow
def test_sweep_command_with_the_megatron_learner(tmp_path):
    model = tmp_path / "model"
    _random_model_dir(model)
    data = tmp_path / "p.jsonl"
    tok_dir = ROOT / "examples" / "tiny" / "base"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (model / f).write_bytes((tok_dir / f).read_bytes())
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?"}) + "\n" for i in range(4)))
    out = tmp_path / "sweep"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "precision_sweep.py"),
                        "--model", str(model), "--data", str(data), "--prompts", "4",
                        "--group", "4", "--lengths", "4,64", "--pairs", "fp32/fp32,bf16/fp32",
                        "--out", str(out)], capture_output=True, text=True, timeout=900,
                       env=env, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    pt = {(p["pair"], p["length"]): p for p in res["points"]}
    assert pt["fp32/fp32", 64]["token_abs_diff_max"] < 1e-4
    assert pt["fp32/fp32", 64]["auto_gspo"] == "rollout"
    assert pt["bf16/fp32", 4]["token_abs_diff_mean"] > 1e-3
    assert pt["bf16/fp32", 64]["seq_mismatch_std"] < pt["bf16/fp32", 4]["seq_mismatch_std"]
    assert res["summary"]["fp32/fp32"]["safe_length_gspo"] == 4


def test_truncate_cuts_an_moe_engine_routing_record_with_the_response():
    from megatron_gspo.data.sample import Sample

    routing = torch.arange(3 + 10 - 1).view(-1, 1, 1).repeat(1, 2, 4).int()  # [P + R - 1, 2, 4]
    s = Sample(prompt_ids=[1, 2, 3], response_ids=list(range(10)), rollout_logprobs=[-1.0] * 10,
               routing=routing)
    for length in (1, 4, 10):
        (cut,) = truncate([s], length)  # Sample validates [P + L - 1, layers, top-k]
        assert tuple(cut.routing.shape) == (3 + length - 1, 2, 4)
        assert torch.equal(cut.routing, routing[: 3 + length - 1])
    assert truncate([Sample(prompt_ids=[1], response_ids=[2, 3])], 1)[0].routing is None


def test_load_prompts_takes_the_first_or_the_longest(tmp_path):
    from transformers import AutoTokenizer

    from bench.precision_sweep import load_prompts

    tok = AutoTokenizer.from_pretrained(ROOT / "examples" / "tiny" / "base")
    texts = ["a", "abcdef", "abc", "abcdefgh", "xyzuvw"]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    first, longest = load_prompts(tok, str(data), 2), load_prompts(tok, str(data), 3, True)
    assert len(first) == 2 and "abcdef" in tok.decode(first[1])
    assert "abc" not in tok.decode(first[0])  # file order: "a", then "abcdef"
    got = [tok.decode(p) for p in longest]
    assert "abcdefgh" in got[0] and "abcdef" in got[1] and "xyzuvw" in got[2]
