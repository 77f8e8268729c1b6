"""GPU check of the memory plan and of the colocated loop's memory order on one GPU: a
random-weight Qwen3-0.6B shaped learner (bf16, local spec, KL reference on the device) takes two
optimizer steps; then

1. resident memory (torch.cuda.memory_allocated) against the plan's weights + gradient buffer
   + main weights + Adam moments + reference (`megatron.memory.plan`);
2. the training peak above that against the plan's activation + logits estimate;
3. the colocated loop (`rollout.offload_learner`), in the order the code runs it: the loop's
   own functions (loop/weight_sync_phase.py `sync_weights`, rollout/multinode/colocated.py) drive
   the
   learner and a probe engine (a RolloutEngine without servers) that records, at every
   memory call the loop makes into the servers, what this process holds: allocated, reserved
   (allocated + torch's cache, which SGLang cannot use until `empty_cache`) and the driver's
   free memory (`torch.cuda.mem_get_info`, what SGLang sizes itself from). Nothing here calls
   `empty_cache`: only the code under test does. Moments: start-up (servers launch, then
   release KV cache and CUDA graphs at once, as loop/train.py has them do), weight
   sync (servers resume weights, then KV cache and CUDA graphs), generation (servers release),
   training (learner back), checkpoint (learner back while the servers' weights stay);
4. onload: allocated memory back to (1), the same log-probs as before, and a step runs.

    python scripts/gpu_memory_check.py [--model qwen3-0.6b|qwen3-1.7b|tiny] [--json OUT.json]

Where the servers take memory (launch, resume) the learner may hold only what the design
leaves it (nothing; its weights while the servers resume theirs) plus 2 % of its resident
bytes (at least 64 MiB on a GPU: the allocator's segments). Without CUDA it runs the tiny shape
on the CPU and counts storage bytes instead (the CPU dry run of scripts/gpu_checks.sh): the
moments are reported, and judged only on a GPU (on the CPU `runtime.device_ledger` models them).
Prints one line per measure; exit 1 when the resident bytes differ from the plan by more than
2 %, a judged moment holds too much, the allocation after onload differs, or the log-probs
changed.
"""

from __future__ import annotations

import argparse
import contextlib
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
# What the design leaves the learner when the servers take memory (colocated.py's docstring):
# nothing at launch and once the stream is sent; its weights while the servers resume theirs.
LEARNER_AT = {"resume weights": ("weights",), "launch": (), "resume kv_cache,cuda_graph": (),
              "resume kv_cache": (), "resume cuda_graph": (), "resume all": ()}


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
    from megatron_gspo.megatron.memory.offload import grad_buffers, optimizer_tensors

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


def snapshot(L, moment: str, event: str, cuda: bool) -> dict:
    """What this process holds now (no `empty_cache`: the cache is part of the measure)."""
    import torch

    if not cuda:
        b = storage_bytes(L)
        return {"moment": moment, "event": event, "allocated": b, "reserved": b, "free": None}
    torch.cuda.synchronize()
    return {"moment": moment, "event": event, "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(), "free": torch.cuda.mem_get_info()[0]}


def probe_engine(L, cuda: bool, rows: list, moment: list):
    """A RolloutEngine without servers: the loop's memory calls reach it through the real
    `release_memory` / `resume_memory` bookkeeping; each records a snapshot; the weight stream
    is consumed bucket by bucket like a server's update."""
    from megatron_gspo.rollout.engine import RolloutEngine

    class Probe(RolloutEngine):
        version = 0

        @property
        def weight_version(self) -> int:
            return self.version

        async def agenerate(self, requests):
            raise NotImplementedError("the memory check does not generate")

        async def aupdate_weights(self, buckets, version):
            for _ in buckets:
                pass
            self.version = version

        async def arelease_memory(self, tags=None):
            rows.append(snapshot(L, moment[0], "release " + ",".join(tags or ["all"]), cuda))

        async def aresume_memory(self, tags=None):
            rows.append(snapshot(L, moment[0], "resume " + ",".join(tags or ["all"]), cuda))

        async def ahealth(self):
            return True

    return Probe()


def size(b: float) -> str:
    return f"{b / 2**30:.3f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def judge(rows: list, parts: dict, resident: int, cuda: bool) -> list[str]:
    """Findings: a moment where the servers take memory while this process holds more than
    the design leaves the learner (LEARNER_AT) plus the slack."""
    slack = max(0.02 * resident, 64 * 2**20 if cuda else 0)
    out = []
    for r in rows:
        keep = LEARNER_AT.get(r["event"])
        if keep is None:
            continue
        r["expected"] = sum(parts[p] for p in keep)
        if r["reserved"] > r["expected"] + slack:
            out.append(f"{r['moment']}: servers {r['event']} while the learner holds "
                       f"{size(r['reserved'])} (allocated {size(r['allocated'])}), expected "
                       f"{size(r['expected'])}")
    return out


def room(L, engine, cuda: bool):
    """The checkpoint's context of loop/train.py: colocated.py's `learner_room` with the parts
    a checkpoint reads where it exists, else `checkpoint_room` (before issue 42's rework)."""
    from megatron_gspo.megatron import learner_state
    from megatron_gspo.rollout.multinode import colocated

    if hasattr(colocated, "learner_room"):
        parts = getattr(learner_state, "CHECKPOINT_PARTS", ("weights", "main", "moments"))
        return colocated.learner_room(L, engine, parts, "checkpoint", cuda=cuda)
    return colocated.checkpoint_room(L, engine, cuda=cuda)


def colocated_order(L, hf: dict, batch, old, before, cuda: bool) -> tuple[list, dict]:
    """Steps 3-4: the loop's moments with a probe engine; returns the snapshots and numbers."""
    from megatron_gspo.config import load_config
    from megatron_gspo.loop import weight_sync_phase as sync
    from megatron_gspo.rollout.multinode import colocated

    cfg = load_config(None, ["model.path=/unused", "model.dtype=bfloat16",
                             "rollout.engine=sglang", "rollout.colocate=true",
                             "rollout.weight_sync=distributed", "rollout.offload_learner=true",
                             "rollout.verify_sync_interval=0"])
    rows: list = []
    moment = ["start-up"]
    out: dict = {}
    # loop/train.py, start-up: the learner offloaded (and its cache returned), then the servers
    # launch and at once release their KV cache and CUDA graphs (colocated.RESUME_AFTER), so
    # the first sync runs as every later one
    moved = L.offload()
    colocated.free_learner_cache()
    rows.append(snapshot(L, "start-up", "launch", cuda))
    engine = probe_engine(L, cuda, rows, moment)
    try:
        engine.release_memory(colocated.RESUME_AFTER)
        for version in (0, 1):
            moment[0] = "weight sync"
            sync.sync_weights(L, engine, hf, cfg, version=version)  # the loop's sync phase
            moment[0] = "generation"  # loop/phases.py `rollout`: the servers release
            released = getattr(sync, "released_after_rollout", None)
            engine.release_memory(released(cfg) if released else None)
            moment[0] = "training"  # loop/train.py: the learner back once they released
            colocated.learner_back(L)
            rows.append(snapshot(L, "training", "learner back", cuda))
            if version == 0:
                out["allocated_after_onload"] = rows[-1]["allocated"]
                out["logprobs_equal"] = L.forward_logprobs(batch) == before
            L.train_step(batch, old)
        moment[0] = "checkpoint"  # loop/train.py at checkpoint.interval
        with room(L, engine, cuda):
            rows.append(snapshot(L, "checkpoint", "learner back", cuda))
    finally:
        engine.shutdown()
    out["offloaded_bytes"] = moved
    out["allocated_after_offload"] = rows[0]["allocated"]
    return rows, out


def summary_line(res: dict) -> str:
    """The memory stage's cell of scripts/gpu_checks.sh's summary (from the --json report):
    the plan's figures, and what the learner held where the servers took memory."""
    def sz(b):
        return "n/a" if b is None else size(b)

    text = (f"{res['model']}: resident {sz(res['resident_bytes'])} (plan "
            f"{sz(res['plan_bytes'])}), training peak {sz(res['train_peak_above_resident'])} "
            f"(plan {sz(res['plan_activation_logits'])}); learner reserved when the servers "
            "took memory: " + ", ".join(
                f"{m['moment']} {m['event']} {sz(m['reserved'])} (expected "
                f"{sz(m['expected'])}, driver free {sz(m['free'])})"
                for m in res.get("moments", []) if "expected" in m))
    found = res.get("order_findings", [])
    if found:
        judged = "" if res.get("order_judged") else " (CPU, not judged)"
        text += f"; {len(found)} finding(s){judged}, first: {found[0]}"
    return text


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

    from megatron_gspo.megatron.memory import plan as mp
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
    parts = {k: getattr(plan, k) for k in ("weights", "grads", "main", "moments", "reference")}
    act = mp.activation_bytes(d, tokens=tokens, layers=d.layers) + \
        mp.logits_bytes(tokens, mp.padded_vocab(d.vocab, 1))
    before = L.forward_logprobs(batch)
    with contextlib.redirect_stdout(sys.stderr):  # the loop's own log lines, if any
        rows, got = colocated_order(L, hf, batch, old, before, cuda)
    same = got["logprobs_equal"]
    findings = judge(rows, parts, resident, cuda)
    res = {"model": name, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "tokens_per_step": tokens, "resident_bytes": resident, "plan_bytes": plan.total,
           "plan_parts": parts, "train_peak_above_resident": peak,
           "plan_activation_logits": act, "offloaded_bytes": got["offloaded_bytes"],
           "allocated_after_offload": got["allocated_after_offload"],
           "allocated_after_onload": got["allocated_after_onload"], "logprobs_equal": same,
           "moments": rows, "order_findings": findings, "order_judged": cuda}
    print(f"resident {resident / 2**30:.3f} GiB, plan {plan.total / 2**30:.3f} GiB "
          f"({100 * (resident - plan.total) / plan.total:+.2f} %)")
    if peak is not None:
        print(f"training peak above resident {peak / 2**30:.3f} GiB, plan estimate "
              f"{act / 2**30:.3f} GiB (x{act / max(peak, 1):.2f})")
    for r in rows:
        free = "" if r["free"] is None else f", driver free {size(r['free'])}"
        print(f"{r['moment']:>11} | {r['event']:<28} allocated {size(r['allocated'])}, "
              f"reserved {size(r['reserved'])}{free}")
    print(f"onload: {size(got['allocated_after_onload'])} allocated, log-probs equal: {same}")
    fails = []
    if abs(resident - plan.total) > 0.02 * plan.total:
        fails.append("resident bytes differ from the plan by more than 2 %")
    if got["allocated_after_offload"] > 0.01 * resident:
        fails.append("more than 1 % stays allocated after offload")
    if got["allocated_after_onload"] != resident:
        fails.append(f"allocated after onload {got['allocated_after_onload']} != {resident}")
    if not same:
        fails.append("log-probs changed across offload/onload")
    fails += findings if cuda else []
    for f in findings if not cuda else []:
        print(f"NOTE (CPU storage bytes, not judged): {f}")
    res["failures"] = fails
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    for f in fails:
        print(f"FAIL: {f}")
    L.shutdown()
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
