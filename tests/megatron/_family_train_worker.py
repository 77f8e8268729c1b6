"""Worker for tests/megatron/test_family_train.py (one rank, launched by `_dist.launch`).

Case `train-<Architecture>` on a tiny model of tests/convert/tiny_families.py:
  1. the embedded engine (transformers) samples responses (MoE: with their routing) and the
     learner, loaded from the same HF checkpoint, gives the engine's log-probs (fp32, 1e-4);
  2. three GSPO steps: generate -> learner step (pi_old = engine log-probs) -> weight sync
     (`export_hf_weights` buckets -> `EmbeddedEngine.load_buckets`); each step trains (finite
     loss, grad norm > 0, weights move) and after each sync the engine again matches the learner;
  3. MoE families: r2 replay equals live routing bitwise (loss, gradients), r3 replays the
     engine's routing on every MoE layer (dense layers skipped), a router share of 1.0.
Writes `<case>.rank0.json` = {"failures": [...], "info": {...}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.megatron._workers import Checker, run_case  # noqa: E402

LP_TOL = 1e-4


def _learner(hf, mode="none", lr=1e-3):
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.step import LossSettings

    return Learner(hf, optim=OptimSettings(lr=lr), seed=3, routing_replay=mode,
                   loss=LossSettings(kind="gspo", eps_low=3e-4, eps_high=4e-4),
                   batching=BatchSettings(num_microbatches=2))


def _load_hf(learner, hf_dir):
    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.megatron.io import dist_checkpoint as cio

    reader = HFCheckpointReader(hf_dir)
    cfg = cio.normalize_hf_config(reader.config)
    adapter = get_adapter(cfg)
    cio.load_hf_weights(learner.chunks, reader, adapter, adapter.dims(cfg))
    learner._refresh_main_params()


def _generate(engine, vocab, seed):
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(seed)
    reqs = [GenerateRequest(prompt_ids=torch.randint(2, vocab, (int(3 + i % 3),),
                                                     generator=g).tolist(),
                            sampling=SamplingParams(max_new_tokens=6, n=2, ignore_eos=True))
            for i in range(4)]
    samples = engine.generate(reqs)
    for i, s in enumerate(samples):
        s.index = i
        s.advantage = 1.0 if i % 2 else -1.0
    return samples


def _lp_err(learner, samples) -> float:
    got = learner.forward_logprobs(samples)
    return max(abs(a - b) for lp, s in zip(got, samples, strict=True)
               for a, b in zip(lp, s.rollout_logprobs, strict=True))


def _sync(learner, engine, cfg, version):
    from megatron_gspo.megatron.io.weight_export import export_hf_weights

    return engine.load_buckets(export_hf_weights(learner.model, cfg, bucket_bytes=1 << 20),
                               version)


def case_train(arch: str, outdir: Path, chk: Checker, info: dict):
    from megatron_gspo.megatron import cpu
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from tests.convert.tiny_families import make_family_model

    cpu.enable()
    hf_dir = outdir / "hf"
    make_family_model(arch, hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    from megatron_gspo.convert.param_map import num_routed_experts

    moe = num_routed_experts(cfg) > 0
    engine = EmbeddedEngine(hf_dir, seed=1, return_routing=moe)
    L = _learner(cfg, "r3" if moe else "none")
    _load_hf(L, hf_dir)
    samples = _generate(engine, int(cfg["vocab_size"]), 0)
    info["engine_vs_learner_lp"] = [_lp_err(L, samples)]
    before = {k: v.clone() for k, v in L.full_state_dict().items()}
    info["steps"] = []
    for step in range(3):
        m = L.train_step(samples, [s.rollout_logprobs for s in samples])
        info["steps"].append({k: m[k] for k in ("loss", "grad_norm", "clip_fraction")})
        if moe:
            info["steps"][-1].update({k: v for k, v in L.routing.pop_metrics(L.device).items()
                                      if not k.startswith("moe/routing_agreement/layer")})
        if not (torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0):
            chk.failures.append(f"step {step}: loss {m['loss']} grad_norm {m['grad_norm']}")
        n = _sync(L, engine, cfg, step + 1)
        samples = _generate(engine, int(cfg["vocab_size"]), step + 1)
        info["engine_vs_learner_lp"].append(_lp_err(L, samples))
        info["synced_tensors"] = n
    after = L.full_state_dict()
    info["moved"] = sum(not torch.equal(before[k], after[k]) for k in before)
    bias = [k for k in before if k.endswith("expert_bias")]
    if any(not torch.equal(before[k], after[k]) or not before[k].abs().sum() > 0 for k in bias):
        chk.failures.append("the router expert bias is not the loaded, frozen one")
    info["expert_bias_tensors"] = len(bias)
    if info["moved"] < len(before) // 2:
        chk.failures.append(f"only {info['moved']} of {len(before)} tensors moved in 3 steps")
    if max(info["engine_vs_learner_lp"]) > LP_TOL:
        chk.failures.append(f"engine vs learner log-probs: {info['engine_vs_learner_lp']}")
    _kl_reference(cfg, samples, after, chk, info)
    if moe:
        _replay(cfg, samples, L.full_state_dict(), chk, info)


def _kl_reference(cfg, samples, full, chk: Checker, info: dict):
    """A frozen KL reference loaded from the same full weights (expert bias and sinks included)
    gives the policy's log-probs, and a KL-in-the-loss step over it trains."""
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.step import LossSettings

    K = Learner(cfg, seed=5, reference=True, batching=BatchSettings(num_microbatches=2),
                loss=LossSettings(kind="gspo", eps_low=3e-4, eps_high=4e-4, kl_coef=0.05,
                                  kl_estimator="k3"))
    K.load_full_state_dict(full)
    K.load_reference(full)
    lps, ref = K.forward_logprobs(samples), K.forward_logprobs(samples, reference=True)
    info["kl_ref_max_diff"] = max(abs(a - b) for x, y in zip(lps, ref, strict=True)
                                  for a, b in zip(x, y, strict=True))
    pol, frozen = ({k: v for k, v in c.state_dict().items() if torch.is_tensor(v)}
                   for c in (K.chunks[0], K.reference_chunks[0]))
    info["kl_ref_weights_equal"] = pol.keys() == frozen.keys() and all(
        torch.equal(pol[k], frozen[k]) for k in pol)
    m = K.train_step(samples, [s.rollout_logprobs for s in samples], ref)
    info["kl_step"] = {k: m[k] for k in ("loss", "kl_loss", "grad_norm")}
    # equal weights bit for bit; the log-probs of the two copies may differ in the last bits:
    # CPU sgemm results depend on the operands' addresses (the policy's weights live in DDP's
    # buffer), measured 6e-7 on DeepSeek-V3's replicated MLA down projections (issue 55)
    if not (info["kl_ref_weights_equal"] and info["kl_ref_max_diff"] <= 1e-6
            and m["grad_norm"] > 0):
        chk.failures.append(f"KL reference: {info['kl_ref_weights_equal']} "
                            f"{info['kl_ref_max_diff']} {info['kl_step']}")


def _replay(cfg, samples, full, chk: Checker, info: dict):
    """r2 == live bitwise; r3 dispatches the engine's routing on the MoE layers."""
    zeros = [[0.0] * len(s.response_ids) for s in samples]
    live = _learner(cfg, "none")
    live.load_full_state_dict(full)
    m_live = live.forward_backward(samples, zeros)
    g_live = live.full_grads()
    rep = _learner(cfg, "r2")
    rep.load_full_state_dict(full)
    rep.forward_logprobs(samples)
    m_rep = rep.forward_backward(samples, zeros)
    g_rep = rep.full_grads()
    if m_rep["loss"] != m_live["loss"] or any(not torch.equal(g_rep[k], g_live[k])
                                              for k in g_live):
        chk.failures.append(f"r2 replay differs from live: {m_rep['loss']} vs {m_live['loss']}")
    info["r2_share"] = rep.routing.pop_metrics(rep.device)["moe/routers_replayed_share"]
    r3 = _learner(cfg, "r3")
    r3.load_full_state_dict(full)
    r3.forward_backward(samples, zeros)
    r3.routing.count_no_record(samples)
    m = r3.routing.pop_metrics(r3.device)
    info["r3"] = {k: v for k, v in m.items() if not k.startswith("moe/routing_agreement/layer")}
    info["r3_layers"] = sorted(k for k in m if k.startswith("moe/routing_agreement/layer"))
    if m["moe/routing_agreement/min"] != 1.0:  # same weights (expert bias included) as the engine
        chk.failures.append(f"r3 learner disagrees with the engine at equal weights: {m}")
    if info["r2_share"] != 1.0 or m["moe/routers_replayed_share"] != 1.0:
        chk.failures.append(f"replayed shares r2 {info['r2_share']} r3 {m}")
    if m["moe/tokens_without_routing_record"] != len(samples):  # the last token of each
        chk.failures.append(f"r3 tokens without record: {m['moe/tokens_without_routing_record']}")


def _grads_run(arch, outdir, layout, keep: list | None = None):
    """Loss and full gradients of one forward-backward from the HF weights (fixed samples);
    the learner is appended to `keep` when given (to step it)."""
    import random

    from megatron_gspo.data.sample import Sample
    from megatron_gspo.megatron import cpu
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.step import LossSettings

    cpu.enable()
    hf_dir = outdir / "hf"
    cfg = json.loads((hf_dir / "config.json").read_text())
    rng = random.Random(0)
    samples = []
    for i in range(6):
        p = [rng.randrange(2, 150) for _ in range(3 + i % 3)]
        r = [rng.randrange(2, 150) for _ in range(4 + i % 4)]
        samples.append(Sample(prompt_ids=p, response_ids=r, loss_mask=[1] * len(r), index=i,
                              advantage=rng.uniform(-1, 1)))
    L = Learner(cfg, layout=layout, optim=OptimSettings(lr=1e-3), seed=11,
                loss=LossSettings(kind="gspo", eps_low=3e-4, eps_high=4e-4),
                batching=BatchSettings(num_microbatches=2))
    _load_hf(L, hf_dir)
    old = [[x + 0.01 for x in lp] for lp in L.forward_logprobs(samples)]
    m = L.forward_backward(samples, old)
    if keep is not None:
        keep.append(L)
    return m, L.full_grads()


def case_ref(arch: str, outdir: Path, chk: Checker, info: dict):
    from tests.convert.tiny_families import make_family_model

    make_family_model(arch, outdir / "hf")
    m, g = _grads_run(arch, outdir, None)
    info["loss"] = m["loss"]
    torch.save({"loss": m["loss"], "grads": g}, outdir / "ref_grads.pt")


def case_par(arch: str, outdir: Path, chk: Checker, info: dict):
    """TP2 (+SP for MoE), PP2 and EP2 give the single process's loss and gradients (1e-5)."""
    from megatron_gspo.convert.param_map import num_routed_experts
    from megatron_gspo.megatron.parallel import ParallelLayout as PL

    ref = torch.load(outdir / "ref_grads.pt")
    cfg = json.loads((outdir / "hf" / "config.json").read_text())
    moe = num_routed_experts(cfg) > 0
    oss = arch == "GptOssForCausalLM"  # expert biases: expert-TP 1, hence EP 2 with TP 2
    layouts = {"tp2": PL(tensor=2, sequence_parallel=moe, expert=2 if oss else 1,
                         expert_tensor=1 if oss else None),
               "pp2": PL(pipeline=2)}
    if moe:
        layouts["ep2"] = PL(expert=2, expert_tensor=1)
    match_reference(arch, outdir, chk, info, layouts, ref)


def match_reference(arch: str, outdir: Path, chk: Checker, info: dict, layouts: dict,
                    ref: dict | None = None) -> None:
    """Each layout's loss and gradients against case_ref's one process (1e-5); `info` gets the
    loss and the largest gradient difference per layout tag."""
    ref = ref if ref is not None else torch.load(outdir / "ref_grads.pt")
    for tag, layout in layouts.items():
        m, g = _grads_run(arch, outdir, layout)
        chk.close(f"{tag}.loss", m["loss"], ref["loss"], rtol=1e-5, atol=1e-8)
        chk.dicts(f"{tag}.grad", g, ref["grads"], rtol=1e-5, atol=1e-8)
        info[tag] = float(m["loss"])
        info[f"{tag}_max_grad_diff"] = max(float((g[k] - ref["grads"][k]).abs().max())
                                           for k in ref["grads"])


def main():
    kind, arch = sys.argv[1].split("-", 1)
    case = {"train": case_train, "ref": case_ref, "par": case_par}[kind]
    run_case({sys.argv[1]: lambda outdir, chk, info: case(arch, outdir, chk, info)})


if __name__ == "__main__":
    main()
