"""GPU check of the memory plan and the learner offload on one GPU: a random-weight Qwen3-0.6B
shaped learner (bf16, local spec, KL reference on the device) takes two optimizer steps; then

1. resident memory (torch.cuda.memory_allocated after empty_cache) against the plan's weights +
   gradient buffer + main weights + Adam moments + reference (`megatron.memory_plan`);
2. the training peak above that against the plan's activation + logits estimate;
3. `offload()`: what stays allocated, and what the GPU driver reports free before/after;
4. `onload()`: allocated memory back to (1), the same log-probs as before the offload, and a
   third step runs.

    python scripts/gpu_memory_check.py [--model qwen3-0.6b|qwen3-1.7b|tiny] [--json OUT.json]

Without CUDA it runs the tiny shape on the CPU and counts storage bytes instead (the CPU dry run
of scripts/gpu_checks.sh). Prints one line per measure; exit 1 when the resident bytes differ
from the plan by more than 2 %, more than 1 % of them stays allocated after `offload`, the
allocation after `onload` differs, or the log-probs changed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "scripts"))

import repo_tests  # noqa: E402

repo_tests.bind()  # `tests` is this repository's folder, whatever else is on the path

SHAPES = {"qwen3-1.7b": ROOT / "examples" / "qwen3_gpu" / "shapes" / "Qwen3-1.7B" / "config.json"}


def hf_shape(name: str) -> dict:
    if name == "tiny":
        from tests.megatron._workers import DENSE

        return dict(DENSE)
    if name in SHAPES:
        return json.loads(SHAPES[name].read_text())
    sys.path.insert(0, str(ROOT / "bench"))
    from learner_step import MODELS  # Qwen3-0.6B's shape

    return dict(MODELS[name])


def samples(n: int, length: int, vocab: int):
    import torch

    from megatron_gspo.data.sample import Sample

    g = torch.Generator().manual_seed(0)
    half = length // 2
    return [Sample(prompt_ids=torch.randint(1, vocab, (half,), generator=g).tolist(),
                   response_ids=torch.randint(1, vocab, (length - half,), generator=g).tolist(),
                   loss_mask=[1] * (length - half), index=i, advantage=0.5 - i % 2)
            for i in range(n)]


def storage_bytes(L) -> int:
    """Bytes of the learner's distinct storages (the CPU stand-in for memory_allocated)."""
    from megatron_gspo.megatron.offload import grad_buffers, optimizer_tensors

    main, state = optimizer_tensors(L.optimizer)
    ts = [p for m in L.chunks + (L.reference_chunks or []) for p in m.parameters()]
    ts += grad_buffers(L.model) + main + state
    seen, total = set(), 0
    for t in ts:
        s = t.untyped_storage()
        if s.data_ptr() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="qwen3-0.6b (GPU default), qwen3-1.7b, tiny")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        from megatron_gspo.megatron.parallel import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    import torch

    from megatron_gspo.megatron import memory_plan as mp
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings

    cuda = torch.cuda.is_available()
    name = args.model or ("qwen3-0.6b" if cuda else "tiny")
    hf = hf_shape(name)
    n, length = (8, 1024) if cuda else (4, 32)
    batch = samples(n, length, int(hf["vocab_size"]))
    tokens = n * length
    L = Learner(hf, params_dtype=torch.bfloat16, use_te=False, reference=True, seed=1,
                optim=OptimSettings(lr=1e-5), batching=BatchSettings(num_microbatches=1))
    L.load_reference()

    def allocated() -> int:
        if not cuda:
            return storage_bytes(L)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    old = L.forward_logprobs(batch)
    L.train_step(batch, old)  # Adam state exists from here
    resident = allocated()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    L.train_step(batch, old)
    peak = torch.cuda.max_memory_allocated() - resident if cuda else None
    d = mp.dims_from_hf(hf)
    plan = mp.learner_bytes(d, param_bytes=2, reference=True)
    act = mp.activation_bytes(d, tokens=tokens, layers=d.layers) + \
        mp.logits_bytes(tokens, mp.padded_vocab(d.vocab, 1))
    before = L.forward_logprobs(batch)
    free0 = torch.cuda.mem_get_info()[0] if cuda else None
    moved = L.offload()
    after_off = allocated()
    free1 = torch.cuda.mem_get_info()[0] if cuda else None
    L.onload()
    after_on = allocated()
    same = L.forward_logprobs(batch) == before
    L.train_step(batch, old)
    res = {"model": name, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "tokens_per_step": tokens, "resident_bytes": resident, "plan_bytes": plan.total,
           "plan_parts": {k: getattr(plan, k) for k in ("weights", "grads", "main", "moments",
                                                        "reference")},
           "train_peak_above_resident": peak, "plan_activation_logits": act,
           "offloaded_bytes": moved, "allocated_after_offload": after_off,
           "driver_free_gain": (free1 - free0) if cuda else None,
           "allocated_after_onload": after_on, "logprobs_equal": same}
    print(f"resident {resident / 2**30:.3f} GiB, plan {plan.total / 2**30:.3f} GiB "
          f"({100 * (resident - plan.total) / plan.total:+.2f} %)")
    if peak is not None:
        print(f"training peak above resident {peak / 2**30:.3f} GiB, plan estimate "
              f"{act / 2**30:.3f} GiB (x{act / max(peak, 1):.2f})")
    print(f"offload: {moved / 2**30:.3f} GiB released, {after_off / 2**20:.1f} MiB still "
          "allocated" + (f", driver free +{(free1 - free0) / 2**30:.3f} GiB" if cuda else ""))
    print(f"onload: {after_on / 2**30:.3f} GiB allocated, log-probs equal: {same}")
    fails = []
    if abs(resident - plan.total) > 0.02 * plan.total:
        fails.append("resident bytes differ from the plan by more than 2 %")
    if after_off > 0.01 * resident:
        fails.append("more than 1 % stays allocated after offload")
    if after_on != resident:
        fails.append(f"allocated after onload {after_on} != {resident}")
    if not same:
        fails.append("log-probs changed across offload/onload")
    res["failures"] = fails
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    for f in fails:
        print(f"FAIL: {f}")
    L.shutdown()
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
