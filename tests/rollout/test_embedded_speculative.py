"""Speculative rollouts of the embedded engine (issue 58 item 3; `rollout.embedded_speculative`,
`rollout.mtp_draft`): what is sampled and the log-probs returned are the target model's.

- the HF-side MTP head = the learner's `mtp_logits` on the same tiny DeepSeek-V3 / GLM-4.5
  checkpoint and on the tiny demo (Qwen3) with a layer under the names `model.mtp_layers: add`
  exports (fp32, <= 1e-5; measured 2.1e-7, 1.6e-7, 8.3e-7), with and without its own cache;
- sampled sequences (4 new tokens, a stop id, temperature 0.8, top-k 4) of a random 6-token
  model with a random MTP head follow the exact sequence probabilities (chi-square over the
  cells expected >= 5 plus one lumped cell); the same engine with an always-accept rule fails;
- log-probs returned with drafting = a teacher-forced target forward of the emitted tokens
  (<= 1e-5) and, greedily, = plain decoding's for the same tokens; greedy tokens equal;
- a stop id or the token budget inside an accepted chain ends the row exactly as plain
  decoding does (nothing after it, finish reasons), and such cases occur in the run;
- tiny DeepSeek-V3 (MLA) and GLM-4.5 MoE checkpoints with their MTP layer: the head loaded from
  the safetensors, greedy = plain, sampled log-probs = teacher-forced;
- a seeded row samples the same whatever rows share its batch;
- the adaptive controller's decisions (`rollout.speculative_control`) and the config refusals.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.rollout import embedded_speculative as es
from megatron_gspo.rollout.embedded import EmbeddedEngine, build_hf_model, sequence_logprobs
from megatron_gspo.rollout.embedded_batch import filter_logits
from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
from megatron_gspo.rollout.speculative_control import REASONS, DraftControl

ROOT = Path(__file__).resolve().parents[2]
V, PROMPT, NEW, STOP = 6, [1, 3, 4], 4, 0
TINY = {"model_type": "qwen3", "vocab_size": V, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 64, "tie_word_embeddings": False}


def _engine(steps: int = 2, seed: int = 0) -> EmbeddedEngine:
    torch.manual_seed(11)
    model = build_hf_model(dict(TINY))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked next-token distributions
    eng = EmbeddedEngine(model, seed=seed, draft_steps=steps, eos_token_ids=[])
    with torch.no_grad():  # a random head, away from its init (acceptance ~ 1/2)
        eng.draft.eh_proj.weight.normal_(0.0, 0.3)
    eng.load_buckets([list(eng.draft.named_tensors().items())], 1)  # the head is "synced"
    return eng


def test_mtp_head_matches_the_learner(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29617")
    archs = "DeepseekV3ForCausalLM,Glm4MoeForCausalLM,Qwen3ForCausalLM"
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_mtp_draft_worker.py")),
                          str(tmp_path), archs], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    print(f"\nMTP draft vs learner: {res}")
    for arch, r in res.items():
        assert r["draft_vs_learner"] <= 1e-5 and r["cached_vs_whole"] <= 1e-5, (arch, r)
        assert r["scale"] > 0.1, (arch, r)


def _exact(eng: EmbeddedEngine, sp: SamplingParams) -> dict[tuple, float]:
    """Probability of every possible response (ends at STOP or after NEW tokens)."""
    seqs = torch.tensor([PROMPT + list(s) for s in itertools.product(range(V), repeat=NEW)])
    with torch.no_grad():
        logits = eng.model(input_ids=seqs).logits[:, len(PROMPT) - 1:-1].float()  # [N, NEW, V]
    n = logits.shape[0]
    scaled = (logits / sp.temperature).reshape(n * NEW, V)
    probs = torch.softmax(filter_logits(scaled, torch.full((n * NEW,), sp.top_k),
                                        torch.full((n * NEW,), sp.top_p)), -1).reshape(n, NEW, V)
    tok = seqs[:, len(PROMPT):]
    step = probs.gather(-1, tok[..., None]).squeeze(-1).double()  # [N, NEW]
    out: dict[tuple, float] = {}
    for row, pr in zip(tok.tolist(), step, strict=True):
        k = row.index(STOP) + 1 if STOP in row else NEW
        key = tuple(row[:k])
        if key not in out:
            out[key] = float(pr[:k].prod())
    return out


def _chi2(eng: EmbeddedEngine, rows: int) -> tuple[float, int, list, int]:
    """(chi-square, degrees of freedom, samples, samples the target cannot produce)."""
    sp = SamplingParams(temperature=0.8, top_k=4, max_new_tokens=NEW, stop_token_ids=(STOP,),
                        n=rows)
    samples = eng.generate([GenerateRequest(prompt_ids=PROMPT, sampling=sp)])
    exact = _exact(eng, sp)
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[tuple(s.response_ids)] = counts.get(tuple(s.response_ids), 0) + 1
    impossible = sum(n for k, n in counts.items() if exact.get(k, 0.0) == 0.0)
    big = [k for k, v in exact.items() if v * rows >= 5]
    rest_e = rows - sum(exact[k] * rows for k in big)
    rest_o = rows - sum(counts.get(k, 0) for k in big)
    chi2 = sum((counts.get(k, 0) - exact[k] * rows) ** 2 / (exact[k] * rows) for k in big)
    chi2 += (rest_o - rest_e) ** 2 / max(rest_e, 1e-9)
    return chi2, len(big), samples, impossible


def _bound(dof: int) -> float:
    return dof + 6 * (2 * dof) ** 0.5


def test_sampled_responses_follow_the_target_distribution():
    eng = _engine(steps=2)
    chi2, dof, samples, impossible = _chi2(eng, 3000)
    m = eng.speculative_metrics()
    print(f"\nengine: chi2 {chi2:.1f} ({dof} dof, bound {_bound(dof):.0f}); {m}")
    assert m["speculative/on"] == 1.0 and 0.2 < m["speculative/acceptance"] < 0.95
    assert impossible == 0 and chi2 < _bound(dof)
    # log-probs: the target's, teacher-forced, for the emitted tokens
    for s in samples[:40]:
        ref = sequence_logprobs(eng.model, PROMPT, s.response_ids, temperature=0.8)
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=1e-5, rtol=0)


def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch):
    real = es.verify_chain

    def accept_all(p, q, draft, u, draw, greedy=None, target_argmax=None):
        return real(p, q, draft, torch.zeros_like(u) - 1, draw)  # u*q < p always

    eng = _engine(steps=2)
    monkeypatch.setattr(es, "verify_chain", accept_all)
    chi2, dof, _, impossible = _chi2(eng, 3000)
    print(f"\nalways accept: chi2 {chi2:.1f} ({dof} dof), {impossible} impossible responses")
    assert chi2 > 3 * _bound(dof) and impossible > 0


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_tokens_and_logprobs_equal_plain_decoding(steps):
    eng = _engine(steps=steps)
    plain = _engine(steps=steps)
    plain.draft_control.ready = False  # no drafting: plain decoding
    prompts = [[1, 2], [3, 4, 5, 1], [5], [2, 2, 2, 3, 1]]
    reqs = [GenerateRequest(prompt_ids=p, sampling=SamplingParams(temperature=0.0,
                                                                  max_new_tokens=9))
            for p in prompts]
    a, b = eng.generate(reqs), plain.generate(reqs)
    assert eng.speculative_metrics()["speculative/on"] == 1.0
    assert plain.speculative_metrics()["speculative/reason"] == REASONS["no_weights"]
    for x, y in zip(a, b, strict=True):
        assert x.response_ids == y.response_ids and x.finish_reason == y.finish_reason
        assert torch.allclose(torch.tensor(x.rollout_logprobs), torch.tensor(y.rollout_logprobs),
                              atol=1e-5, rtol=0)


def test_stops_and_budget_inside_accepted_chains(monkeypatch):
    seen = {"stop_inside": 0, "budget_inside": 0}
    real = es.verify_chain

    def spy(p, q, draft, u, draw, greedy=None, target_argmax=None):
        acc, toks = real(p, q, draft, u, draw, greedy=greedy, target_argmax=target_argmax)
        for a, t in zip(acc.tolist(), toks.tolist(), strict=True):
            seen["stop_inside"] += STOP in t[:a]  # a stop among the accepted drafts
        return acc, toks

    monkeypatch.setattr(es, "verify_chain", spy)
    eng = _engine(steps=3)
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=(STOP,), n=40)
    out = eng.generate([GenerateRequest(prompt_ids=p, sampling=sp)
                        for p in ([1, 3, 4], [2, 5], [4])])
    for s in out:
        ids = s.response_ids
        assert 1 <= len(ids) <= 5
        assert (STOP not in ids[:-1]) and (s.finish_reason == "stop") == (ids[-1] == STOP)
        assert s.finish_reason == "stop" or len(ids) == 5
        seen["budget_inside"] += len(ids) == 5 and ids[-1] != STOP
        ref = sequence_logprobs(eng.model, s.prompt_ids, ids)
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=1e-5, rtol=0)
    print(f"\n{seen}")
    assert seen["stop_inside"] > 0 and seen["budget_inside"] > 0


def test_routing_capture_with_drafting_is_refused():
    from tests.convert.tiny_families import FAMILIES

    with pytest.raises(ValueError, match="return_routing"):
        EmbeddedEngine(dict(FAMILIES["DeepseekV3ForCausalLM"][1]), draft_steps=1,
                       return_routing=True)


def test_adaptive_controller_decisions():
    c = DraftControl(adaptive=True, max_batch=8, min_acceptance=0.4, probe_interval=3,
                     smoothing=1.0)
    assert not c.decide(4) and c.metrics()["speculative/reason"] == REASONS["no_weights"]
    c.ready = True
    assert c.decide(4)  # never measured: draft
    c.record({"drafted": 10, "accepted": 8, "emitted": 12, "verify_steps": 5, "row_verifies": 5})
    m = c.metrics()
    assert m["speculative/acceptance"] == 0.8 and m["speculative/accepted_per_verify"] == 1.6
    assert m["speculative/tokens_per_verify"] == 12 / 5 and m["speculative/on"] == 1.0
    assert not c.decide(9) and c.metrics()["speculative/reason"] == REASONS["batch"]
    c.decide(4)
    c.record({"drafted": 10, "accepted": 1})  # acceptance 0.1 < 0.4
    assert [c.decide(4) for _ in range(6)] == [False, False, True, False, False, True]
    assert c.metrics()["speculative/reason"] == REASONS["probe"]
    c.record({"drafted": 10, "accepted": 9})  # the probe measures a recovered head
    assert c.decide(4) and c.metrics()["speculative/reason"] == REASONS["on"]
    assert DraftControl(adaptive=False, ready=True).decide(10_000)
    with pytest.raises(ValueError, match="probe_interval"):
        DraftControl(probe_interval=0)


def test_config_refusals():
    from megatron_gspo.config import ConfigError, load_config
    from megatron_gspo.loop.speculative_setting import check, embedded_kwargs

    tiny = ROOT / "examples" / "tiny" / "config.yaml"
    with pytest.raises(ConfigError, match=r"^rollout.speculative.num_steps: not used with "
                                          r"rollout.speculative.algorithm 'none'"):
        load_config(tiny, ["rollout.speculative.num_steps=3"])
    with pytest.raises(ConfigError, match=r"^rollout.speculative.max_batch: not used with "
                                          r"rollout.speculative.adaptive false"):
        load_config(tiny, ["rollout.speculative.algorithm=mtp", "rollout.speculative.adaptive="
                           "false", "rollout.speculative.max_batch=8"])
    srv = ["rollout.engine=sglang", "rollout.speculative.algorithm=mtp",
           "model.mtp_layers=keep"]  # SGLang servers draft every request: no switch there
    with pytest.raises(ConfigError, match=r"^rollout.speculative.adaptive: true with "
                                          r"rollout.engine 'sglang'"):
        load_config(tiny, srv + ["rollout.speculative.adaptive=true"])
    with pytest.raises(ConfigError, match=r"^rollout.speculative.min_acceptance: not used with "
                                          r"rollout.speculative.adaptive off with rollout.engine"):
        load_config(tiny, srv + ["rollout.speculative.min_acceptance=0.5"])
    assert load_config(tiny, srv).rollout.speculative.adaptive is None
    on = ["rollout.speculative.algorithm=mtp", "model.mtp_layers=add"]
    with pytest.raises(ConfigError, match="learner builds none"):
        check(load_config(tiny, on), mtp_built=False, moe=False)
    with pytest.raises(ConfigError, match="^rollout.speculative.topk: 2"):
        check(load_config(tiny, on + ["rollout.speculative.topk=2"]), True, False)
    with pytest.raises(ConfigError, match="^rollout.speculative.num_draft_tokens: 5"):
        check(load_config(tiny, on + ["rollout.speculative.num_draft_tokens=5"]), True, False)
    with pytest.raises(ConfigError, match="moe.engine_routing"):
        check(load_config(tiny, on), True, moe=True)
    cfg = load_config(tiny, on + ["rollout.speculative.num_steps=3"])
    check(cfg, True, False)
    kw = embedded_kwargs(cfg)
    assert kw["draft_steps"] == 3 and kw["draft_control"].max_batch == 64
    assert kw["draft_control"].adaptive  # null: the embedded engine's switch is on
    assert embedded_kwargs(load_config(tiny)) == {}


def test_a_seeded_row_samples_the_same_with_other_rows_in_its_batch():
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7)
    alone = _engine(steps=2).generate([GenerateRequest(prompt_ids=[1, 3, 4], sampling=sp)])
    crowd = _engine(steps=2).generate(
        [GenerateRequest(prompt_ids=[2, 5], sampling=SamplingParams(max_new_tokens=10, n=3)),
         GenerateRequest(prompt_ids=[1, 3, 4], sampling=sp)])
    assert crowd[-1].response_ids == alone[0].response_ids


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"])
def test_moe_checkpoint_with_its_mtp_layer(arch, tmp_path):
    """A checkpoint that ships its MTP layer (MLA / GQA attention, MoE layers): the engine loads
    the head from the safetensors and drafts; greedy = plain, sampled log-probs = teacher-forced."""
    from tests.convert.tiny_mtp import make_mtp_checkpoint

    make_mtp_checkpoint(arch, tmp_path)
    eng = EmbeddedEngine(str(tmp_path), draft_steps=2, eos_token_ids=[])
    assert eng.draft_control.ready
    plain = EmbeddedEngine(str(tmp_path), eos_token_ids=[])
    reqs = [GenerateRequest(prompt_ids=p, sampling=SamplingParams(temperature=0.0,
                                                                  max_new_tokens=8))
            for p in ([5, 9, 13], [7, 1, 2, 3, 4, 8], [11])]
    for x, y in zip(eng.generate(reqs), plain.generate(reqs), strict=True):
        assert x.response_ids == y.response_ids
        assert torch.allclose(torch.tensor(x.rollout_logprobs), torch.tensor(y.rollout_logprobs),
                              atol=1e-5, rtol=0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, n=4)
    for s in eng.generate([GenerateRequest(prompt_ids=[5, 9, 13], sampling=sp)]):
        ref = sequence_logprobs(eng.model, s.prompt_ids, s.response_ids)
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=1e-5, rtol=0)
    assert eng.speculative_metrics()["speculative/on"] == 1.0
