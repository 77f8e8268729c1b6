"""Worker processes for the LoRA learner tests (launched by `_dist.launch`).

Cases:
  lora1 (1 rank)  dense (all dense targets) and MoE (qkv, proj, experts) learners: each adapted
                  layer's output and gradients vs a float64 reference; B = 0 gives the base
                  model's log-probs bit for bit; with random B the log-probs equal a full model
                  holding the merged weights and the adapter gradients equal the chain rule
                  through that model's weight gradients; a GSPO and a GSPO-token step move the
                  adapters only; the merged export (partial sync) changes only the targeted
                  layers and serves the learner's log-probs through transformers; KL reference
                  = adapters off (no second model); adapter-only checkpoint and bit-identical
                  resume; the PEFT adapter loaded by `peft` gives the learner's log-probs.
  lora2 (2 ranks) TP2, TP2+SP, PP2, DP2, DP2 + distributed optimizer (dense) and EP2 (MoE)
                  against lora1: log-probs, loss, adapter gradients and post-step adapters
                  within 1e-6 (MoE TP2+SP+EP2: 1e-5 / 1e-4); the TP2 adapter checkpoint
                  loaded under PP2 gives the same adapters bit for bit. Also bf16 LoRA steps
                  (lora1).
Each rank writes `<case>.rank<r>.json` = {"failures": [...], "info": {...}}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.megatron._workers import DENSE, MOE, Checker, run_case, make_samples, old_logprobs  # noqa: E402

TARGETS = {"dense": ("qkv", "proj", "fc1", "fc2"), "moe": ("qkv", "proj", "experts")}
MODELS = {"dense": DENSE, "moe": MOE}


def _learner(model, layout=None, *, targets=None, loss=None, reference=False, seed=7,
             lora=True, dtype=torch.float32, distopt=False):
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.lora.adapters import LoraSettings
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.step import LossSettings

    settings = LoraSettings(rank=4, alpha=8.0, targets=targets or TARGETS[model]) \
        if lora else None
    # adam_eps well above the smallest adapter gradients (~1e-8 here): Adam's first update
    # lr * g / (|g| + eps) would otherwise amplify float32 reduction-order noise in them
    return Learner(MODELS[model], layout=layout, seed=seed,
                   optim=OptimSettings(lr=1e-2, adam_eps=1e-4, use_distributed_optimizer=distopt),
                   params_dtype=dtype,
                   loss=loss or LossSettings(), batching=BatchSettings(num_microbatches=2),
                   reference=reference, lora=settings)


def _adapters(full: dict) -> dict:
    return {k: v for k, v in full.items() if k.endswith((".lora_a", ".lora_b"))}


def _base(full: dict) -> dict:
    return {k: v for k, v in full.items() if not k.endswith((".lora_a", ".lora_b"))}


def _random_b(full: dict, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (0.3 * torch.randn(v.shape, generator=g) if k.endswith(".lora_b") else v)
            for k, v in full.items()}


def _merged(full: dict, scale: float) -> dict:
    out = _base(full)
    for k in full:
        if k.endswith(".lora_a"):
            w = k[: -len(".lora_a")] + ".weight"
            out[w] = (out[w].double() + scale * full[w[:-7] + ".lora_b"].double()
                      @ full[k].double()).float()
    return out


def _flat(lps):
    return [x for y in lps for x in y]


def _module_check(chk: Checker, L, tag: str):
    """Each adapted layer (first layer / first expert) vs float64: output, dA, dB, dx."""
    from megatron_gspo.megatron.lora import adapters as lora

    g = torch.Generator().manual_seed(11)
    kinds = set()
    for _, m in lora.adapted_modules(L.chunks[0]):
        kind = m.lora_info.kind
        if kind in kinds:
            continue
        kinds.add(kind)
        for mm in L.model:
            mm.zero_grad_buffer()
        x = torch.randn(5, 1, m.weight.shape[1], generator=g)
        xr = x.clone().requires_grad_(True)
        out, bias = m(xr)
        up = torch.randn(out.shape, generator=g)
        (out * up).sum().backward()
        x64 = x.double().requires_grad_(True)
        a64 = m.lora_a.detach().double().requires_grad_(True)
        b64 = m.lora_b.detach().double().requires_grad_(True)
        ref = x64 @ m.weight.detach().double().T + m.lora_info.scale * (x64 @ a64.T) @ b64.T
        (ref * up.double()).sum().backward()
        chk.close(f"{tag}.{kind}.out", out, ref, rtol=1e-6)
        chk.close(f"{tag}.{kind}.dA", m.lora_a.main_grad, a64.grad, rtol=1e-5)
        chk.close(f"{tag}.{kind}.dB", m.lora_b.main_grad, b64.grad, rtol=1e-5)
        chk.close(f"{tag}.{kind}.dx", xr.grad, x64.grad, rtol=1e-5)
        if m.weight.requires_grad or m.weight.grad is not None:
            chk.failures.append(f"{tag}.{kind}: the base weight is trainable")
    want = {"dense": {"qkv", "proj", "fc1", "fc2"},
            "moe": {"qkv", "proj", "experts.fc1", "experts.fc2"}}[tag]
    if kinds != want:
        chk.failures.append(f"{tag}: adapted kinds {sorted(kinds)} != {sorted(want)}")


def _memory_check(chk: Checker, L, model: str, info: dict):
    """The memory plan's LoRA terms equal the live learner's buffers and adapter count."""
    from megatron_gspo.megatron.lora import adapters as lora
    from megatron_gspo.megatron.memory import plan as mp

    dims = mp.dims_from_hf(MODELS[model])
    plan = mp.learner_bytes(dims, param_bytes=4, lora=(4, TARGETS[model]))
    full = mp.learner_bytes(dims, param_bytes=4)
    n = sum(p.numel() for _, p in lora.adapter_parameters(L.chunks))
    grads = sum(b.grad_data.numel() for m in L.model
                for b in m.buffers + list(m.expert_parallel_buffers)) * 4
    weights = sum(p.numel() for c in L.chunks for p in c.parameters()) * 4
    got = (plan.weights, plan.grads, plan.moments, plan.reference)
    if got != (weights, grads, 8 * n, 0):
        chk.failures.append(f"{model}: memory plan (weights, grads, moments, ref) {got} != "
                            f"learner {(weights, grads, 8 * n, 0)}")
    info[f"{model}.plan_state_bytes"] = [plan.state, full.state]


def _reference_run(chk: Checker, model: str, samples, outdir: Path, info: dict) -> dict:
    """Float64 layer checks, step-0 identity, merged-model equivalence, the single-process
    numbers the 2-rank case compares with."""
    L = _learner(model)
    _memory_check(chk, L, model, info)
    full0 = L.full_state_dict()
    B = _learner(model, lora=False, seed=8)  # the same base, no adapters
    B.load_full_state_dict(_base(full0))
    base_lps = B.forward_logprobs(samples)
    if _flat(L.forward_logprobs(samples)) != _flat(base_lps):
        chk.failures.append(f"{model}: B = 0 does not give the base model's log-probs bit for bit")
    full = _random_b(full0)
    L.load_full_state_dict(full)
    _module_check(chk, L, model)
    scale = L.lora.scale
    B.load_full_state_dict(_merged(full, scale))
    lps = L.forward_logprobs(samples)
    chk.close(f"{model}.logprobs vs merged full model", _flat(lps),
              _flat(B.forward_logprobs(samples)), rtol=1e-5)
    old = old_logprobs(lps)
    m = L.forward_backward(samples, old)
    grads = _adapters(L.full_grads())
    mb = B.forward_backward(samples, old)
    chk.close(f"{model}.loss vs merged", m["loss"], mb["loss"], rtol=1e-5)
    gw = B.full_grads()
    for k in grads:  # dA = s B^T dW, dB = s dW A^T
        w = k.rsplit(".", 1)[0] + ".weight"
        a, b = full[w[:-7] + ".lora_a"].double(), full[w[:-7] + ".lora_b"].double()
        want = scale * (b.T @ gw[w].double() if k.endswith("lora_a") else gw[w].double() @ a.T)
        chk.close(f"{model}.grad {k} vs chain rule", grads[k], want, rtol=1e-4, atol=1e-8)
    L.optimizer_step()
    after = L.full_state_dict()
    moved = [k for k in full if not torch.equal(full[k], after[k])]
    if not moved or any(not k.endswith((".lora_a", ".lora_b")) for k in moved):
        chk.failures.append(f"{model}: the step moved {moved[:4]} (adapters only expected)")
    info[f"{model}.adapters_moved"] = len(moved)
    return dict(full=full, lps=lps, old=old, metrics=m, grads=grads, after=_adapters(after))


def _hf_model(model: str, state: dict):
    import transformers

    cfg = dict(MODELS[model])
    arch = cfg.pop("architectures")[0]
    conf = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    hf = getattr(transformers, arch)(conf).float().eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise AssertionError(f"HF load: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if cfg.get("tie_word_embeddings"):
        hf.tie_weights()
    return hf


@torch.no_grad()
def _hf_logprobs(hf, samples) -> list[list[float]]:
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        lg = hf(ids).logits[0].double().log_softmax(-1)
        p = len(s.prompt_ids)
        out.append([lg[p - 1 + i, t].item() for i, t in enumerate(s.response_ids)])
    return out


def _export(L, **kw) -> dict:
    from megatron_gspo.megatron.io.weight_export import export_hf_weights

    return {n: t.clone() for b in export_hf_weights(L.chunks, DENSE, bucket_bytes=1 << 30, **kw)
            for n, t in b}


def _sync_check(chk: Checker, samples, info: dict):
    """First sync: every weight; after a step only the adapted layers' merged weights, which
    change exactly the targeted HF tensors; the served model then gives the learner's lps."""
    L = _learner("dense", targets=("qkv", "fc2"))
    engine = _hf_model("dense", _export(L))
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    lps = L.forward_logprobs(samples)
    L.train_step(samples, old_logprobs(lps))
    sent = _export(L, only_adapted=True)
    want = {f"model.layers.{i}.{n}.weight" for i in range(4)
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")}
    if set(sent) != want:
        chk.failures.append(f"partial sync sent {sorted(set(sent) ^ want)[:4]} wrongly")
    engine.load_state_dict(sent, strict=False)
    changed = {k for k, v in engine.state_dict().items() if not torch.equal(v, before[k])}
    if changed != want:
        chk.failures.append(f"sync changed {sorted(changed ^ want)[:4]} wrongly")
    info["sync.sent"] = len(sent)
    chk.close("synced engine lps", _flat(_hf_logprobs(engine, samples)),
              _flat(L.forward_logprobs(samples)), rtol=1e-5)


def _steps_and_kl(chk: Checker, samples, info: dict):
    from megatron_gspo.megatron.step import LossSettings

    for kind, dtype in (("gspo", torch.float32), ("gspo_token", torch.float32),
                        ("gspo-bf16", torch.bfloat16)):
        L = _learner("dense", loss=LossSettings(kind=kind.split("-")[0]), seed=5, dtype=dtype)
        full = L.full_state_dict()
        lps = L.forward_logprobs(samples)
        ms = [L.train_step(samples, old_logprobs(lps, seed=s)) for s in range(3)]
        after = L.full_state_dict()
        moved = {k for k in full if not torch.equal(full[k], after[k])}
        if not all(m["update_skipped"] == 0 and abs(m["loss"]) < 1e3 for m in ms) or not moved \
                or any(not k.endswith((".lora_a", ".lora_b")) for k in moved):
            chk.failures.append(f"{kind} LoRA steps: {ms[-1]}, moved {sorted(moved)[:3]}")
        info[f"{kind}.loss"] = ms[-1]["loss"]
    loss = LossSettings(kind="gspo", kl_coef=0.05, kl_estimator="k3")
    L = _learner("dense", loss=loss, reference=True, seed=6)
    if L.reference_chunks is not None or L.reference_bytes() != 0:
        chk.failures.append("LoRA + KL built a second model")
    full = _random_b(L.full_state_dict(), seed=4)
    L.load_full_state_dict(full)
    B = _learner("dense", lora=False, seed=8)
    B.load_full_state_dict(_base(full))
    ref = L.forward_logprobs(samples, reference=True)
    if _flat(ref) != _flat(B.forward_logprobs(samples)):
        chk.failures.append("adapters-off reference != the base model's log-probs")
    pol, ref2 = L.forward_logprobs_with_reference(samples)
    if _flat(ref2) != _flat(ref) or _flat(pol) != _flat(L.forward_logprobs(samples)):
        chk.failures.append("forward_logprobs_with_reference disagrees with the two passes")
    if _flat(pol) == _flat(ref):
        chk.failures.append("policy == reference with nonzero adapters (check is vacuous)")
    m = L.train_step(samples, old_logprobs(pol), ref)
    info["kl_loss"] = m["kl_loss"]
    if not m["kl_loss"] > 0:
        chk.failures.append(f"KL part not active: {m['kl_loss']}")


def _checkpoint_check(chk: Checker, samples, outdir: Path, info: dict):
    from torch.distributed.checkpoint import FileSystemReader

    L = _learner("dense", seed=5)
    base = _base(L.full_state_dict())
    lps = L.forward_logprobs(samples)
    L.train_step(samples, old_logprobs(lps))
    path = outdir / "ckpt-lora"
    L.save_checkpoint(str(path))
    saved = L.full_state_dict()
    m1 = L.train_step(samples, old_logprobs(lps, seed=9))
    after1 = L.full_state_dict()
    keys = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    info["ckpt.keys"] = len(keys)
    base_keys = [k for k in keys if k.endswith(".weight") or "embedding" in k]
    if base_keys or not any("lora_a" in k for k in keys):
        chk.failures.append(f"LoRA checkpoint keys: base {base_keys[:3]}, all {sorted(keys)[:3]}")
    from megatron_gspo.megatron.io import dist_checkpoint as checkpoint_io

    B = _learner("dense", lora=False, seed=78)  # a base Megatron checkpoint (model.load_checkpoint)
    B.load_full_state_dict(base)
    checkpoint_io.save_checkpoint(B.chunks, outdir / "base-ckpt", metadata={})
    L2 = _learner("dense", seed=77)  # other adapter init: all of it must come from the file
    checkpoint_io.load_checkpoint(L2.chunks, outdir / "base-ckpt")
    if any(not torch.equal(v, L2.full_state_dict()[k]) for k, v in base.items()):
        chk.failures.append("a base Megatron checkpoint did not load into the LoRA learner")
    L2.load_checkpoint(str(path))
    got = L2.full_state_dict()
    if any(not torch.equal(got[k], saved[k]) for k in saved):
        chk.failures.append("LoRA checkpoint did not restore the adapters bit for bit")
    m2 = L2.train_step(samples, old_logprobs(lps, seed=9))
    after2 = L2.full_state_dict()
    diff = [k for k in after1 if not torch.equal(after1[k], after2[k])]
    if diff or m1["loss"] != m2["loss"] or m1["grad_norm"] != m2["grad_norm"]:
        chk.failures.append(f"resumed step not bit-identical: {diff[:3]}, {m1['loss']} vs "
                            f"{m2['loss']}")
    _peft_check(chk, L2, samples, outdir, info)


def _peft_check(chk: Checker, L, samples, outdir: Path, info: dict):
    from peft import PeftModel

    from megatron_gspo.convert.registry import get_adapter
    from megatron_gspo.megatron.lora import adapters as lora
    from megatron_gspo.megatron.io.dist_checkpoint import normalize_hf_config
    from megatron_gspo.megatron.lora.io import write_peft_adapter

    dims = get_adapter(DENSE).dims(normalize_hf_config(DENSE))
    out = write_peft_adapter(outdir / "peft", _adapters(L.full_state_dict()), dims, L.lora, None)
    with lora.adapters_off(L.chunks):
        base = _export(L)
    merged = _export(L)
    pm = PeftModel.from_pretrained(_hf_model("dense", base), str(out)).eval()
    want = _flat(L.forward_logprobs(samples))
    got = _flat(_hf_logprobs(pm, samples))
    err = max(abs(a - b) for a, b in zip(got, want, strict=True))
    info["peft.max_abs_logprob_diff"] = err
    if not err <= 1e-5:
        chk.failures.append(f"peft-loaded adapter log-probs differ from the learner's by {err}")
    folded = pm.merge_and_unload().state_dict()
    for k, v in merged.items():
        chk.close(f"peft merge_and_unload {k}", folded[k], v, rtol=1e-6)


def case_lora1(outdir: Path, chk: Checker, info: dict):
    from megatron_gspo.megatron import cpu

    cpu.enable()
    samples = make_samples()
    ref = {name: _reference_run(chk, name, samples, outdir, info) for name in MODELS}
    torch.save(ref, outdir / "lora_ref.pt")
    _steps_and_kl(chk, samples, info)
    _sync_check(chk, samples, info)
    _checkpoint_check(chk, samples, outdir, info)


def case_lora2(outdir: Path, chk: Checker, info: dict):
    from megatron_gspo.megatron import parallel

    R = torch.load(outdir / "lora_ref.pt", weights_only=False)
    samples = make_samples()
    PL = parallel.ParallelLayout
    layouts = (("dense", "tp2", PL(tensor=2)),
               ("dense", "tp2sp", PL(tensor=2, sequence_parallel=True)),
               ("dense", "pp2", PL(pipeline=2)), ("dense", "dp2", PL()),
               ("dense", "dp2-distopt", PL()),
               ("moe", "ep2", PL(expert=2)),
               ("moe", "tp2sp-ep2", PL(tensor=2, expert=2, expert_tensor=1,
                                       sequence_parallel=True)))
    for model, name, layout in layouts:
        r = R[model]
        L = _learner(model, layout, seed=99, distopt=name.endswith("distopt"))
        L.load_full_state_dict(r["full"])
        tag = f"{model}.{name}"
        chk.close(f"{tag}.logprobs", _flat(L.forward_logprobs(samples)), _flat(r["lps"]),
                  rtol=1e-6)
        m = L.forward_backward(samples, r["old"])
        chk.close(f"{tag}.loss", m["loss"], r["metrics"]["loss"], rtol=1e-6)
        # MoE under TP + SP + EP: the dispatcher's all-to-all and sequence shards reorder the
        # float32 sums (gradients ~5e-6 apart; Adam's first update lr * g / |g| amplifies it).
        # Dense TP + SP: each rank sums its own sequence shard's tokens into the adapters'
        # gradients before the TP reduction (megatron-core 0.19.2 puts qkv's lora_a gradient
        # 2.4e-6 relative from one process's float32 sum; 0.16.1 within 1e-6)
        gtol, atol = {"tp2sp-ep2": (1e-5, 1e-4), "tp2sp": (1e-5, 1e-6)}.get(name, (1e-6, 1e-6))
        if not name.endswith("distopt"):  # (gradients are reduce-scattered there)
            chk.dicts(f"{tag}.grad", _adapters(L.full_grads()), r["grads"], rtol=gtol)
        L.optimizer_step()
        chk.dicts(f"{tag}.after", _adapters(L.full_state_dict()), r["after"], rtol=atol)
        if name == "tp2":
            L.save_checkpoint(str(outdir / "ckpt-tp2"))
            saved = _adapters(L.full_state_dict())
        info[tag] = m["loss"]
        if name == "pp2":  # the TP2 checkpoint, resharded: the same adapters bit for bit
            L2 = _learner(model, layout, seed=98)
            L2.load_full_state_dict(_base(r["full"]))
            L2.load_checkpoint(str(outdir / "ckpt-tp2"))
            got = _adapters(L2.full_state_dict())
            if any(not torch.equal(got[k], saved[k]) for k in saved):
                chk.failures.append("TP2 LoRA checkpoint loaded under PP2 differs")
            del L2


def main():
    run_case({"lora1": case_lora1, "lora2": case_lora2})


if __name__ == "__main__":
    main()
