"""Runs in its own process (the learner starts torch.distributed and the CPU layer):
real engine/learner mismatch audit, the `auto` fallback and return, and the first-mini-batch
ratio identity. Prints one JSON line of results for tests/precision/test_precision_e2e.py."""

import json
import sys
import tempfile

import torch


def tiny_model_dir() -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hc = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2,
                     pad_token_id=3, rms_norm_eps=1e-6)
    m = Qwen3ForCausalLM(hc)
    with torch.no_grad():  # sharper distributions than the default init, like a trained model
        for n, p in m.named_parameters():
            if n.endswith("weight") and p.dim() == 2:
                p.mul_(3.0)
    d = tempfile.mkdtemp()
    m.save_pretrained(d)
    return d


def main() -> None:
    from megatron_gspo.loop import build, phases
    from megatron_gspo.loop import weight_sync_phase as sync_phase
    from megatron_gspo.algo.precision import (ToleranceController, audit_sums, finalize_audit,
                                              sequence_mismatch)
    from megatron_gspo.config import load_config
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    d = tiny_model_dir()
    cfg = load_config(None, [f"model.path={d}", "model.dtype=float32", "optimizer.lr=3e-4",
                             "rollout.group_size=4", "train.prompts_per_step=8",
                             "algorithm.mini_batches=4", "rollout.max_new_tokens=24",
                             "algorithm.micro_batch_tokens=100000"])
    hf = build.read_hf_config(d)
    learner = build.learner(cfg, hf)
    build.load_initial_weights(cfg, learner, hf)
    engines = {dt: EmbeddedEngine(dict(hf), dtype=dt, seed=1) for dt in ("bfloat16", "float32")}
    for dt, eng in engines.items():
        cfg.rollout.dtype = dt
        sync_phase.sync_weights(learner, eng, hf, cfg, version=0)
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, n=4)
    g = torch.Generator().manual_seed(5)
    reqs = [GenerateRequest(prompt_ids=torch.randint(10, 250, (6,), generator=g).tolist(),
                            sampling=sp) for _ in range(8)]
    out = {}

    def pad(rows):
        w = max(len(r) for r in rows)
        t = torch.zeros(len(rows), w)
        for i, r in enumerate(rows):
            t[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
        return t

    # Direct computation: the HF model in float32 on the generated sequences.
    from transformers import AutoModelForCausalLM
    ref_model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()

    def direct(samples):
        rows = []
        with torch.no_grad():
            for s in samples:
                ids = torch.tensor([s.prompt_ids + s.response_ids])
                lp = torch.log_softmax(ref_model(ids).logits[0].float(), -1)
                p = len(s.prompt_ids)
                tgt = ids[0, p:]
                rows.append(lp[p - 1:-1].gather(-1, tgt[:, None])[:, 0].tolist())
        return rows

    for dt, eng in engines.items():
        samples = eng.generate(reqs)
        lps = learner.forward_logprobs(samples)
        mask = pad([s.loss_mask for s in samples])
        eng_t = pad([s.rollout_logprobs for s in samples])
        audit = finalize_audit(audit_sums(pad(lps), eng_t, mask, eps_low=3e-4, eps_high=4e-4))
        dref = finalize_audit(audit_sums(pad(direct(samples)), eng_t, mask, eps_low=3e-4,
                                         eps_high=4e-4))
        out[dt] = {"audit": audit, "direct": dref,
                   "learner_vs_direct_max": float((pad(lps) - pad(direct(samples))).abs().max())}
    # With pi_old = engine (bf16, a real mismatch), the first mini-batch's ratios are exp(d_i).
    samples = engines["bfloat16"].generate(reqs)
    for i, s in enumerate(samples):
        s.reward = float((i * 7) % 5)
    phases.fill_advantages(cfg, samples)
    lps = learner.forward_logprobs(samples)
    mb = samples[:8]
    d_i = sequence_mismatch(pad(lps[:8]), pad([s.rollout_logprobs for s in mb]),
                            pad([s.loss_mask for s in mb]))
    met = learner.train_step(mb, None)
    r = torch.exp(d_i.double())
    out["first_ratio"] = {"ratio_mean": met["ratio_mean"], "ratio_min": met["ratio_min"],
                          "ratio_max": met["ratio_max"], "exp_d_mean": float(r.mean()),
                          "exp_d_min": float(r.min()), "exp_d_max": float(r.max())}
    # auto: in sync -> reuse; the learner trains on while the engine keeps stale weights ->
    # fallback; sync again -> back under tolerance -> reuse after `recheck_interval` steps.
    ctl = ToleranceController("auto", audit_fraction=1.0, tolerance=0.2, recheck_interval=2)
    eng = engines["float32"]
    sync_phase.sync_weights(learner, eng, hf, cfg, version=1)
    trace = []
    for step in range(6):
        if step == 1:
            for _ in range(3):
                learner.train_step(samples[8:16], None)  # the learner moves on; engine stale
        if step == 3:
            sync_phase.sync_weights(learner, eng, hf, cfg, version=2)
        batch = eng.generate(reqs[:4])
        lp = learner.forward_logprobs(batch)
        a = finalize_audit(audit_sums(pad(lp), pad([s.rollout_logprobs for s in batch]),
                                      pad([s.loss_mask for s in batch]), eps_low=3e-4,
                                      eps_high=4e-4))
        trace.append((step, a["out_of_range_fraction"], ctl.decide(step, a)))
    out["auto_trace"] = trace
    out["auto_events"] = ctl.events
    learner.shutdown()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
