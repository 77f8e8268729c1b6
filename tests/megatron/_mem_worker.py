"""Worker processes for the memory-plan and offload tests (launched by `_dist.launch`).

Cases:
  bytes (4 ranks)  for TP / PP / VPP / EP / DP layouts of the tiny dense and MoE models, with
                   and without the distributed optimizer: the bytes of this rank's weights,
                   gradient buffer, main weights, Adam moments and reference storages equal
                   `memory_plan.learner_bytes` for this rank.
  act   (1 rank)   tensors saved for backward in one CPU micro-batch (saved-tensor hooks,
                   parameters excluded) against `activation_bytes + logits_bytes`.
  stage (4 ranks)  the tensors each rank hands Megatron-Core's writer in a checkpoint (what
                   `preload_tensors` copies into pinned host memory on GPU) equal
                   `memory.staging.staged_tensor_bytes` for this rank, tensor for tensor.
  off   (2 ranks)  TP2 and PP2 (bf16, fp32 main weights; distributed optimizer under TP2):
                   5 steps with the learner offloaded and onloaded between steps equal 5 steps
                   without (loss, grad norm, weights: bit-identical), every storage is empty
                   while offloaded, and a checkpoint saved while offloaded resumes to the
                   same steps 4-5.
Each rank writes `<case>.rank<r>.json` = {"failures": [...], "info": {...}}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.megatron._workers import DENSE, MODELS, make_samples, old_logprobs  # noqa: E402


def _unique_bytes(tensors, skip=()) -> int:
    seen, total = set(skip), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def measured(L) -> dict:
    """Bytes of this rank's learner storages, by part."""
    from megatron_gspo.megatron.memory.offload import grad_buffers, optimizer_tensors

    weights = [p for m in L.chunks for p in m.parameters()]
    wptrs = {p.untyped_storage().data_ptr() for p in weights}
    main, state = optimizer_tensors(L.optimizer)
    ref = [p for m in (L.reference_chunks or []) for p in m.parameters()]
    return {"weights": _unique_bytes(weights), "grads": _unique_bytes(grad_buffers(L.model)),
            "main": _unique_bytes(main, wptrs), "moments": _unique_bytes(state),
            "reference": _unique_bytes(ref)}


def case_bytes(outdir: Path, failures: list, info: dict):
    from megatron.core import parallel_state as ps

    from megatron_gspo.megatron.memory import plan as mp
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.parallel import ParallelLayout as PL

    samples = make_samples()
    layouts = [
        ("dense", "dp4", PL(), False, torch.bfloat16),
        ("dense", "dp4-distopt", PL(), True, torch.bfloat16),
        ("dense", "tp2-dp2-distopt", PL(tensor=2, sequence_parallel=True), True, torch.bfloat16),
        ("dense", "pp2-dp2-distopt", PL(pipeline=2), True, torch.bfloat16),  # tied: shared
        ("dense", "tp2-pp2", PL(tensor=2, pipeline=2), False, torch.bfloat16),
        ("dense", "pp2-vpp2-fp32-distopt", PL(pipeline=2, virtual_pipeline=2), True,
         torch.float32),
        ("moe", "ep2-distopt", PL(expert=2), True, torch.bfloat16),
        ("moe", "tp2-ep2-etp1-distopt", PL(tensor=2, expert=2, expert_tensor=1,
                                           sequence_parallel=True), True, torch.bfloat16),
        ("moe", "ep4", PL(expert=4), False, torch.bfloat16),
        ("moe", "pp2-ep2", PL(pipeline=2, expert=2), False, torch.bfloat16),
    ]
    for model, name, lay, distopt, dtype in layouts:
        tag = f"{model}.{name}"
        L = Learner(MODELS[model], layout=lay, params_dtype=dtype, seed=3,
                    optim=OptimSettings(lr=1e-3, use_distributed_optimizer=distopt),
                    batching=BatchSettings(num_microbatches=2), reference=name == "dp4")
        if name == "dp4":
            L.load_reference()
        L.train_step(samples, old_logprobs(L.forward_logprobs(samples)))  # Adam state exists
        got = measured(L)
        plan = mp.learner_bytes(
            mp.dims_from_hf(MODELS[model]), tp=lay.tensor, pp=lay.pipeline, ep=lay.expert,
            etp=lay.expert_tensor, vpp=lay.virtual_pipeline or 1, dp=L.dp_size,
            distributed=distopt, param_bytes=torch.finfo(dtype).bits // 8,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            edp_rank=ps.get_expert_data_parallel_rank(), reference=name == "dp4")
        want = {"weights": plan.weights, "grads": plan.grads, "main": plan.main,
                "moments": plan.moments, "reference": plan.reference}
        if got != want:
            failures.append(f"{tag}: measured {got} != plan {want}")
        info[tag] = got


def case_stage(outdir: Path, failures: list, info: dict):
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.memory import plan as mp
    from megatron_gspo.megatron.memory import staging
    from megatron_gspo.megatron.memory.report import PlanInputs
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.parallel import ParallelLayout as PL

    seen: list[int] = []
    orig = fa.FileSystemWriterAsync.prepare_write_data

    def record(self, plan, planner):  # the tensors the writer will stage (this rank's)
        orig(self, plan, planner)
        seen.extend(t.numel() * t.element_size() for _, _, (_, ts) in self.write_buckets
                    for _, t in ts)

    fa.FileSystemWriterAsync.prepare_write_data = record
    samples = make_samples()
    for model, name, lay, distopt, dtype in [
        ("dense", "tp2-dp2-distopt", PL(tensor=2, sequence_parallel=True), True, torch.bfloat16),
        ("dense", "dp4", PL(), False, torch.bfloat16),
        ("dense", "tp2-pp2", PL(tensor=2, pipeline=2), False, torch.bfloat16),  # tied
        ("dense", "pp2-vpp2-fp32-distopt", PL(pipeline=2, virtual_pipeline=2), True,
         torch.float32),
        ("moe", "tp2-ep2-etp1-distopt", PL(tensor=2, expert=2, expert_tensor=1,
                                           sequence_parallel=True), True, torch.bfloat16),
    ]:
        L = Learner(MODELS[model], layout=lay, params_dtype=dtype, seed=3,
                    optim=OptimSettings(lr=1e-3, use_distributed_optimizer=distopt),
                    batching=BatchSettings(num_microbatches=2))
        L.train_step(samples, old_logprobs(L.forward_logprobs(samples)))  # Adam state exists
        seen.clear()
        L.save_checkpoint(str(outdir / f"ckpt-{model}-{name}"))
        x = PlanInputs(dims=mp.dims_from_hf(MODELS[model]), gpu_bytes=0, world=4,
                       gpus_per_node=4, tp=lay.tensor, pp=lay.pipeline,
                       vpp=lay.virtual_pipeline or 1, ep=lay.expert, etp=lay.expert_tensor,
                       distributed_optimizer=distopt, param_bytes=torch.finfo(dtype).bits // 8)
        want = sorted(staging.staged_tensor_bytes(x, dist.get_rank()))
        if sorted(seen) != want:
            failures.append(f"{model}.{name}: staged {sorted(seen)} != plan {want}")
        info[f"{model}.{name}"] = sum(seen)
        dist.barrier()


def case_act(outdir: Path, failures: list, info: dict):
    from megatron_gspo.data.sample import Sample
    from megatron_gspo.megatron.memory import plan as mp
    from megatron_gspo.megatron.learner import BatchSettings, Learner

    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(1, 100, (20,), generator=g).tolist(),
                      response_ids=torch.randint(1, 100, (44,), generator=g).tolist(),
                      loss_mask=[1] * 44, index=i, advantage=0.5 - i % 2) for i in range(8)]
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    d = mp.dims_from_hf(DENSE)
    for recompute in (False, True):
        L = Learner(DENSE, params_dtype=torch.bfloat16, seed=3, recompute=recompute,
                    batching=BatchSettings(num_microbatches=1))
        old = old_logprobs(L.forward_logprobs(samples))
        wptrs = {p.untyped_storage().data_ptr() for m in L.chunks for p in m.parameters()}
        saved: dict[int, int] = {}

        def pack(t, wptrs=wptrs, saved=saved):
            s = t.untyped_storage()
            if s.data_ptr() not in wptrs and s.device.type == "cpu":
                saved[s.data_ptr()] = max(saved.get(s.data_ptr(), 0), s.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            L.forward_backward(samples, old)
        est = mp.activation_bytes(d, tokens=tokens, layers=d.layers, recompute=recompute) \
            + mp.logits_bytes(tokens, mp.padded_vocab(d.vocab, 1))
        info[f"recompute={recompute}"] = {"tokens": tokens, "measured": sum(saved.values()),
                                          "estimate": est}


def _storages_empty(L) -> list[str]:
    from megatron_gspo.megatron.memory.offload import grad_buffers, optimizer_tensors

    main, state = optimizer_tensors(L.optimizer)
    groups = {"weights": [p for m in L.chunks for p in m.parameters()],
              "grads": grad_buffers(L.model), "main": main, "moments": state,
              "reference": [p for m in (L.reference_chunks or []) for p in m.parameters()]}
    return [f"{k}: {sum(t.untyped_storage().nbytes() > 0 for t in v)} of {len(v)} kept storage"
            for k, v in groups.items() if any(t.untyped_storage().nbytes() > 0 for t in v)]


def case_off(outdir: Path, failures: list, info: dict):
    from megatron_gspo.megatron.parallel import ParallelLayout as PL

    for name, lay, distopt in (("tp2", PL(tensor=2), True), ("pp2", PL(pipeline=2), False)):
        _off_layout(outdir, failures, info, name, lay, distopt)


def _off_layout(outdir: Path, failures: list, info: dict, name: str, lay, distopt: bool):
    import torch.distributed as dist

    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings

    samples = make_samples()

    def learner():
        L = Learner(DENSE, layout=lay, params_dtype=torch.bfloat16, seed=11,
                    reference=True, optim=OptimSettings(lr=1e-3,
                                                        use_distributed_optimizer=distopt),
                    batching=BatchSettings(num_microbatches=2))
        L.load_reference()
        return L

    def outside_step(L):  # pp2: main weights + moments away during forward/backward too
        from megatron_gspo.megatron.memory.offload import optimizer_tensors

        L.offload_outside_step = True
        orig = L.forward_backward

        def fb(*a, **k):
            out = orig(*a, **k)
            kept = [t for t in sum(optimizer_tensors(L.optimizer), [])
                    if t.untyped_storage().nbytes() > 0]
            if kept and L.steps:
                failures.append(f"{name}: {len(kept)} main/moment storages kept in fwd/bwd")
            return out

        L.forward_backward = fb
        return L

    def steps(L, n, offload, ckpt=None, at=None):
        if offload and name == "pp2":
            outside_step(L)
        rows = []
        for k in range(n):
            L.onload()
            m = L.train_step(samples, old_logprobs(L.forward_logprobs(samples)))
            rows.append([m["loss"], m["grad_norm"]])
            if offload:
                moved = L.offload()
                empty = _storages_empty(L)
                if empty:
                    failures.append(f"{name} step {k}: after offload {empty}")
                info[f"{name}.offloaded_bytes"] = moved
            if ckpt is not None and k + 1 == at:
                L.save_checkpoint(str(ckpt))
                if offload and not L.offloaded_parts():
                    failures.append(f"{name}: saving a checkpoint left the learner onloaded")
        L.onload()
        return rows, L.full_state_dict()

    ckpt = outdir / f"ckpt-{name}"
    base_rows, base_w = steps(learner(), 5, False)
    off_rows, off_w = steps(learner(), 5, True, ckpt, at=3)
    if off_rows != base_rows:
        failures.append(f"{name}: offloaded loss/grad norm {off_rows} != {base_rows}")
    bad = [k for k in base_w if not torch.equal(base_w[k], off_w[k])]
    if bad:
        failures.append(f"{name}: weights differ after 5 offloaded steps: {bad[:4]}")
    L = learner()
    L.load_checkpoint(str(ckpt))
    res_rows, res_w = steps(L, 2, True)
    if res_rows != base_rows[3:]:
        failures.append(f"{name}: resumed steps {res_rows} != {base_rows[3:]}")
    bad = [k for k in base_w if not torch.equal(base_w[k], res_w[k])]
    if bad:
        failures.append(f"{name}: weights differ after resume: {bad[:4]}")
    info[name] = base_rows
    dist.barrier()


def main():
    case, outdir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    from megatron_gspo.megatron import cpu

    cpu.enable()
    torch.manual_seed(0)
    failures, info = [], {}
    try:
        cases = {"bytes": case_bytes, "act": case_act, "off": case_off, "stage": case_stage}
        cases[case](outdir, failures, info)
    except Exception:
        failures.append("exception:\n" + traceback.format_exc())
    (outdir / f"{case}.rank{rank}.json").write_text(json.dumps(
        {"failures": failures, "info": info}))
    os._exit(0 if not any(f.startswith("exception") for f in failures) else 1)


if __name__ == "__main__":
    main()
