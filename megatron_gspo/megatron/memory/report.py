"""The memory plan of a run config: `megatron-gspo plan CONFIG`, and the trainer's check at
start on a GPU (arithmetic in `megatron.memory.plan`).

    megatron-gspo plan CONFIG [a.b=c ...] [--gpu-memory 80GiB] [--gpus-per-node 8] [--nodes 1]
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from megatron_gspo.megatron.memory import hybrid
from megatron_gspo.megatron.memory import plan as mp
from megatron_gspo.megatron.memory import staging
from megatron_gspo.megatron.memory.plan import GiB, Plan
from megatron_gspo.runtime.sglang_pools import ServerKnobs

# Fixed allowances (not measured here): CUDA contexts of the learner and the server process,
# NCCL buffers and allocator slack on every GPU; SGLang's CUDA graphs and its forward
# activations, which live in the share of free memory that --mem-fraction-static leaves out.
CONTEXT_BYTES = 3 * GiB
CUDA_GRAPH_BYTES = 2 * GiB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PlanInputs:
    """Numbers the plan needs (`inputs_from_config` fills them from a config)."""

    dims: mp.Dims
    gpu_bytes: int
    world: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    sp: bool = False
    distributed_optimizer: bool = False
    offload_outside_step: bool = False
    param_bytes: int = 2
    reference: bool = False
    reference_offload: bool = False
    micro_batch_tokens: int = 4096
    recompute: bool = False
    colocated_sglang: bool = False
    offload_learner: bool = False
    server_tp: int = 1
    mem_fraction: float = 0.7
    kv_tokens_needed: int = 0
    bucket_bytes: int = 512 * 2**20
    vocab_multiple: int = 128
    lora: tuple | None = None  # (rank, targets) of model.lora; None = full fine-tuning
    delta_base: str | None = None  # rollout.weight_sync_delta_base ("copy"/"hash"); None = off
    knobs: ServerKnobs = ServerKnobs()  # SGLang flags sizing a hybrid's pools (extra args)
    batch_per_server: int = 0  # the step's requests over the servers (one generation round)
    server_fp8: bool = False  # rollout.weight_precision fp8: block-FP8 server weights

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)


def offload_learner_enabled(cfg) -> bool:
    """`rollout.offload_learner` resolved: null means on with colocated SGLang servers."""
    r = cfg.rollout
    colocated = r.engine == "sglang" and r.colocate
    return colocated if r.offload_learner is None else bool(r.offload_learner and colocated)


def inputs_from_config(cfg, hf_config: dict, *, gpu_bytes: int, gpus_per_node: int,
                       nodes: int = 1, world: int | None = None) -> PlanInputs:
    """`PlanInputs` of a run config on `nodes` x `gpus_per_node` GPUs of `gpu_bytes` each."""
    from megatron_gspo.megatron.models.builder import VOCAB_PAD_MULTIPLE  # vocabulary padding

    p, r = cfg.parallel, cfg.rollout
    colocated = r.engine == "sglang" and r.colocate
    servers = r.num_servers * (nodes if colocated else 1)
    batch = int(cfg.train.prompts_per_step * r.over_sample) * r.group_size
    return PlanInputs(
        dims=mp.dims_from_hf(hf_config), gpu_bytes=gpu_bytes,
        world=world or nodes * gpus_per_node, gpus_per_node=gpus_per_node, tp=p.tensor,
        pp=p.pipeline, vpp=p.virtual_pipeline or 1, ep=p.expert, etp=p.expert_tensor,
        cp=p.context, sp=p.sequence_parallel,
        distributed_optimizer=cfg.optimizer.distributed_optimizer,
        offload_outside_step=cfg.optimizer.offload_outside_step,
        param_bytes=DTYPE_BYTES[cfg.model.dtype], reference=cfg.algorithm.kl_coef > 0,
        reference_offload=cfg.model.reference_offload,
        micro_batch_tokens=cfg.algorithm.micro_batch_tokens,
        recompute=cfg.model.recompute_activations, colocated_sglang=colocated,
        offload_learner=offload_learner_enabled(cfg), server_tp=r.tp_size,
        mem_fraction=r.mem_fraction,
        kv_tokens_needed=cfg.data.max_prompt_length + r.max_new_tokens,
        bucket_bytes=r.bucket_bytes, vocab_multiple=VOCAB_PAD_MULTIPLE,
        lora=(cfg.model.lora.rank, tuple(cfg.model.lora.targets)) if cfg.model.lora.rank
        else None, delta_base=r.weight_sync_delta_base if r.engine == "sglang"
        and r.weight_sync_delta != "off" else None,
        knobs=ServerKnobs.from_argv(r.extra_server_args) if hybrid.is_hybrid(hf_config)
        else ServerKnobs(), batch_per_server=-(-batch // max(1, servers)),
        server_fp8=r.engine == "sglang" and r.weight_precision == "fp8")


def _worst_learner(x: PlanInputs) -> mp.LearnerBytes:
    """The pipeline stage (rank 0 of its DP group) holding the most learner bytes."""
    best = None
    for pp_rank in range(x.pp):
        b = mp.learner_bytes(x.dims, tp=x.tp, pp=x.pp, ep=x.ep, etp=x.etp, vpp=x.vpp,
                             dp=x.dp, cp=x.cp, distributed=x.distributed_optimizer,
                             param_bytes=x.param_bytes, pp_rank=pp_rank,
                             reference=x.reference, vocab_multiple=x.vocab_multiple,
                             lora=x.lora)
        if best is None or b.total > best.total:
            best = b
    return best


def build_plan(x: PlanInputs, host: bool = True) -> Plan:
    """Rows and moments of one GPU for `x` (see `megatron.memory.plan`); `host`: also the
    pinned host memory of a rank and of a node (offloaded learner, checkpoint staging)."""
    if x.world % (x.tp * x.pp * x.cp):
        raise ValueError(f"{x.world} GPUs do not split into TP {x.tp} x PP {x.pp} x CP {x.cp}")
    d = x.dims
    lb = _worst_learner(x)
    ref_dev = 0 if x.reference_offload else lb.reference
    layers = d.layers // x.pp
    in_flight = x.pp  # the first stage under 1F1B
    act = mp.activation_bytes(d, tokens=x.micro_batch_tokens, layers=layers, tp=x.tp, sp=x.sp,
                              cp=x.cp, etp=x.etp, recompute=x.recompute, in_flight=in_flight,
                              act_bytes=x.param_bytes)
    vocab_local = mp.padded_vocab(d.vocab, x.tp, x.vocab_multiple) // x.tp
    logits = mp.logits_bytes(x.micro_batch_tokens, vocab_local, x.cp)
    grad_dtype = "fp32"
    etp = x.tp if x.etp is None else x.etp
    edp = x.tp * x.cp * x.dp // (x.ep * etp)
    shard = f"sharded over DP {x.dp * x.cp}" + (f", experts over {edp}" if x.ep > 1 else "")
    rows = [
        ("learner weights", lb.weights, f"{x.param_bytes} B/param, TP{x.tp} PP{x.pp} EP{x.ep}"
         + (", padded buffer" if x.distributed_optimizer else "")),
        ("gradient buffer", lb.grads, f"{grad_dtype} (grad_reduce_in_fp32)"
         + (f", LoRA r={x.lora[0]} adapters only" if x.lora else "")),
        ("main weights", lb.main, "fp32, " + (shard if x.distributed_optimizer else
                                              "not sharded") if lb.main else
         "none (fp32 parameters)"),
        ("optimizer moments", lb.moments, "Adam fp32 x2, " + (
            shard if x.distributed_optimizer else "not sharded")),
        ("KL reference", ref_dev, "off" if not x.reference else "the base (LoRA off)"
         if x.lora else ("in CPU memory" if x.reference_offload else f"{x.param_bytes} B/param")),
        ("activations", act, f"{x.micro_batch_tokens} tokens/micro-batch, "
         + ("full recompute" if x.recompute else "no recompute")
         + (f", {in_flight} in flight (PP)" if in_flight > 1 else "") + " (estimate)"),
        ("logits / log-probs", logits, f"{vocab_local} vocab rows/rank (estimate)"),
        ("CUDA contexts, NCCL", CONTEXT_BYTES, "allowance"),
    ]
    plan = Plan(gpu_bytes=x.gpu_bytes, rows=rows, kv_tokens_needed=x.kv_tokens_needed)
    train_parts = ["learner weights", "gradient buffer", "main weights", "optimizer moments",
                   "KL reference", "activations", "logits / log-probs", "CUDA contexts, NCCL"]
    if x.offload_outside_step:  # main weights + moments only in the optimizer step
        fwd = [n for n in train_parts if n not in ("main weights", "optimizer moments")]
        opt = [n for n in train_parts if n not in ("activations", "logits / log-probs")]
        plan.moments.append(("forward/backward", sum(plan.term(n) for n in fwd), fwd))
        plan.moments.append(("optimizer step", sum(plan.term(n) for n in opt), opt))
    else:
        plan.moments.append(("training", sum(plan.term(n) for n in train_parts), train_parts))
    if x.colocated_sglang:
        total_params = _total_params(x)
        sg_w, sg_note = _server_weights(x, total_params)
        state = ["gradient buffer", "main weights", "optimizer moments", "KL reference"]
        # what is resident when the server starts and sizes its KV cache: optimizer moments
        # are created by the first step, so they are not there yet (without offload)
        at_launch = [] if x.offload_learner else ["learner weights", "gradient buffer",
                                                   "main weights", "KL reference"]
        free = x.gpu_bytes - CONTEXT_BYTES - sum(plan.term(n) for n in at_launch)
        cell = mp.kv_cell_bytes(d, x.server_tp)
        state_rows = hybrid.state_rows(plan, x, free, sg_w, cell) if d.linear else []
        if not d.linear:
            plan.kv_tokens = mp.sglang_kv_tokens(free, sg_w, x.mem_fraction, cell)
        kv = plan.kv_tokens * cell
        rows += [("SGLang weights", sg_w, sg_note),
                 ("SGLang KV cache", kv, f"{plan.kv_tokens} tokens ({cell} B/token"
                  + (", full-attention layers" if d.linear else "") + f"), "
                  f"mem_fraction {x.mem_fraction} of {free / GiB:.1f} GiB free at launch"),
                 *state_rows,
                 ("SGLang CUDA graphs", CUDA_GRAPH_BYTES, "allowance"),
                 ("weight-sync bucket", 2 * x.bucket_bytes, "exported + flattened copy"),
                 *([("FP8 quantize buffer", _fp8_buffer(x.dims), "largest projection: "
                     "fp32 copy, scaled copy and e4m3 result while it is quantized")]
                   if x.server_fp8 else [])]
        sglang = ["SGLang weights", "SGLang KV cache", *(n for n, _, _ in state_rows),
                  "SGLang CUDA graphs"]
        learner_gen = [] if x.offload_learner else ["learner weights", *state]
        gen = ["CUDA contexts, NCCL", *learner_gen, *sglang]
        plan.moments.append(("generation", sum(plan.term(n) for n in gen), gen))
        if x.lora or x.delta_base:  # the servers keep their weights (LoRA, delta sync)
            for i, (name, _, parts) in enumerate(plan.moments[:-1]):
                parts = [*parts, "SGLang weights"]
                plan.moments[i] = (name, sum(plan.term(n) for n in parts), parts)
        sync = ["CUDA contexts, NCCL", "learner weights",
                *([] if x.offload_learner else state), "SGLang weights", "weight-sync bucket",
                *(["FP8 quantize buffer"] if x.server_fp8 else [])]
        plan.moments.append(("weight sync", sum(plan.term(n) for n in sync), sync))
        if x.delta_base:  # the full re-sync after a failed delta probe, in a sync's room
            plan.moments.append(("delta retry", sum(plan.term(n) for n in sync), sync))
        _room_moments(plan, x, gen, at_launch)
        if free * (1 - x.mem_fraction) < CUDA_GRAPH_BYTES:
            plan.problems.append(
                f"rollout.mem_fraction {x.mem_fraction}: leaves "
                f"{free * (1 - x.mem_fraction) / GiB:.1f} GiB of the {free / GiB:.1f} GiB free "
                f"at launch for CUDA graphs and activations (< {CUDA_GRAPH_BYTES / GiB:.0f} GiB)")
    if host:  # the offloaded learner + every checkpoint's pinned staging copy (kept cached)
        offloaded = pinned_host_bytes(x)
        plan.staging_bytes, node_staging = staging.worst_and_node_staging(x)
        plan.host_bytes = offloaded + plan.staging_bytes
        plan.node_host_bytes = offloaded * min(x.gpus_per_node, x.world) + node_staging
    if x.delta_base:  # rank 0's copy of what the servers hold; each server rank's loader copy
        n = _total_params(x)
        plan.delta_host_bytes = (n * x.param_bytes if x.delta_base == "copy"
                                 else 64 * (12 * d.layers + 3))
        plan.delta_server_bytes = n * x.param_bytes if x.delta_base == "copy" else 0
    plan.check()
    return plan


def _room_moments(plan: Plan, x: PlanInputs, gen: list[str], at_launch: list[str]) -> None:
    """Start-up, resume, checkpoint and sync-probe moments of colocated SGLang, in the order
    the loop runs them (`rollout.multinode.colocated`): the learner is built with its weights,
    gradient buffer, main weights (and on resume the moments read from the checkpoint), then
    offloaded with its cache returned before the servers start; a checkpoint brings back the
    parts it saves (weights, main weights, moments) while the servers keep only their weights;
    a sync probe brings back the learner's weights alone."""
    built = ["CUDA contexts, NCCL", "learner weights", "gradient buffer", "main weights",
             "KL reference"]
    launched = ["CUDA contexts, NCCL", *at_launch, "SGLang weights", "SGLang KV cache",
                *(n for n, _, _ in plan.rows if n == hybrid.STATE_ROW), "SGLang CUDA graphs"]
    for name, extra in (("start-up", []), ("resume", ["optimizer moments"])):
        parts = max((built + extra, launched), key=lambda ps: sum(plan.term(n) for n in ps))
        plan.moments.append((name, sum(plan.term(n) for n in parts), parts))
    for name, back in (("checkpoint", ["learner weights", "main weights", "optimizer moments"]),
                       ("sync probe", ["learner weights"])):
        parts = ["CUDA contexts, NCCL", "SGLang weights", *back] if x.offload_learner else gen
        plan.moments.append((name, sum(plan.term(n) for n in parts), parts))


def pinned_host_bytes(x: PlanInputs) -> int:
    """Pinned host memory of one rank's offloaded learner (`megatron.memory.offload`): one host
    buffer per offloaded storage (the weight buffer, each main-weight shard and each Adam moment
    tensor), each rounded up to a power of two by torch's CachingHostAllocator
    (aten/src/ATen/core/CachingHostAllocator.h); gradients are dropped, not copied."""
    if not (x.offload_learner or x.offload_outside_step):
        return 0
    lb = _worst_learner(x)
    shards = _main_shard_numels(x)
    main_b = 0 if x.param_bytes == 4 else 4
    per_storage = [n * main_b for n in shards if main_b] + [n * 4 for n in shards] * 2
    if x.offload_learner:
        per_storage.append(lb.weights)
    return sum(_pow2(n) for n in per_storage if n)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _main_shard_numels(x: PlanInputs) -> list[int]:
    """Elements of this rank's main-weight shard of each trainable parameter (the fp32 copy
    the optimizer steps; the whole parameter without the distributed optimizer)."""
    etp = x.tp if x.etp is None else x.etp
    out = []
    for vp in range(x.vpp):
        ps = mp.chunk_params(x.dims, tp=x.tp, pp=x.pp, ep=x.ep, etp=etp, vpp=x.vpp, pp_rank=0,
                             vp_stage=vp, vocab_multiple=x.vocab_multiple, lora=x.lora)
        for expert, group in ((False, x.dp * x.cp), (True, x.tp * x.cp * x.dp // (x.ep * etp))):
            sel = [p for p in ps if p.expert == expert and p.trainable]
            if not sel:
                continue
            _, spans, buckets = mp.buffer_ranges([p.numel for p in sel], [p.shared for p in sel],
                                                 group, x.distributed_optimizer)
            for s, e in spans:
                n = mp.shard_elements([(s, e)], buckets, group, 0) if \
                    x.distributed_optimizer else e - s
                if n:
                    out.append(n)
    return out


def ledger_spec(plan: Plan, x: PlanInputs, name: str, tolerance: float = 0.05):
    """The device-memory ledger's spec (`runtime.device_ledger`) for one GPU of this plan: part
    sizes, the plan's figure per moment (training: the larger of forward/backward and the
    optimizer step) and SGLang's KV sizing inputs."""
    from megatron_gspo.runtime.device_ledger import LedgerSpec

    moments = {n: b for n, b, _ in plan.moments}
    train = [b for n, b, _ in plan.moments if n in ("training", "forward/backward",
                                                    "optimizer step")]
    moments["training"] = max(train)
    moments.pop("forward/backward", None)
    moments.pop("optimizer step", None)
    return LedgerSpec(name=name, gpu_bytes=x.gpu_bytes, sizes={n: b for n, b, _ in plan.rows},
                      plan_moments=moments, plan_kv_tokens=plan.kv_tokens,
                      mem_fraction=x.mem_fraction,
                      kv_cell_bytes=mp.kv_cell_bytes(x.dims, x.server_tp), tolerance=tolerance,
                      hybrid=hybrid.ledger_fields(x))



def _server_weights(x: PlanInputs, total_params: int) -> tuple[int, str]:
    """One server GPU's weight bytes and the row's note. FP8 (`rollout.weight_precision`):
    embeddings, lm_head and routers stay BF16, every other parameter is counted as block FP8
    (1 byte, plus a float32 scale per 128 x 128 block): an upper bound of what FP8 saves, as
    norms, kept layers and fused modules off the 128 grid stay BF16 (`quant.blockfp8`)."""
    if not x.server_fp8:
        return total_params * 2 // x.server_tp, f"bf16, server TP{x.server_tp}"
    d = x.dims
    kept = d.vocab * d.hidden * (1 if d.tied else 2) + d.layers * d.experts * d.hidden
    fp8 = max(0, total_params - kept)
    return ((2 * kept + fp8 + 4 * fp8 // (128 * 128)) // x.server_tp,
            f"fp8 projections (block scales fp32), bf16 embeddings / lm_head / routers, "
            f"server TP{x.server_tp}")


def _fp8_buffer(d) -> int:
    """Bytes the learner-side quantizer holds for the largest projection it quantizes
    (`quant.blockfp8.quantize`: a float32 copy, the scaled float32 blocks, the e4m3 result)."""
    largest = d.hidden * max(d.ffn, d.expert_ffn, d.shared_ffn, d.heads * d.head_dim)
    return 9 * largest


def _total_params(x: PlanInputs) -> int:
    """Parameters of the whole model (no padding, tied embedding once)."""
    one = dataclasses.replace(x, tp=1, pp=1, vpp=1, ep=1, etp=1, cp=1, world=1,
                              distributed_optimizer=False, param_bytes=4, reference=False)
    return mp.learner_bytes(x.dims, tp=1, pp=1, ep=1, etp=1, vpp=1, dp=1, param_bytes=4,
                            vocab_multiple=one.vocab_multiple).weights // 4


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '141G', '1.5TiB' -> bytes (GB = 10^9, GiB and G = 2^30)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a memory size: {text!r} (e.g. 80GiB, 80GB)")
    exp = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    base = 1000 if m.group(3).upper() == "B" else 1024
    return int(float(m.group(1)) * base**exp)


def format_plan(plan: Plan, x: PlanInputs, changes: str | None = None) -> str:
    """The table of `megatron-gspo plan`; `changes`: the line naming what makes it fit
    (`changes.describe_changes`), printed when it does not."""
    lines = [f"memory plan per GPU: {x.world} GPUs ({x.gpus_per_node} per node) of "
             f"{x.gpu_bytes / GiB:.1f} GiB; TP{x.tp} PP{x.pp} CP{x.cp} EP{x.ep} DP{x.dp}"
             + (", distributed optimizer" if x.distributed_optimizer else "")
             + (", colocated SGLang" + (", learner offloaded while generating"
                                        if x.offload_learner else "")
                if x.colocated_sglang else ""), ""]
    lines += [f"  {n:<22} {b / GiB:8.2f} GiB  {note}" for n, b, note in plan.rows]
    lines.append("")
    for name, total, _ in plan.moments:
        lines.append(f"  {name:<22} {total / GiB:8.2f} GiB  "
                     f"({100 * total / plan.gpu_bytes:.0f}% of the GPU)")
    if plan.host_bytes:
        off = plan.host_bytes - plan.staging_bytes
        lines.append(f"  {'pinned host memory':<22} {plan.host_bytes / GiB:8.2f} GiB  per rank: "
                     + (f"offloaded learner {off / GiB:.2f} + " if off else "")
                     + f"checkpoint staging {plan.staging_bytes / GiB:.2f} (power-of-two "
                     "blocks)")
        lines.append(f"  {'pinned host, one node':<22} {plan.node_host_bytes / GiB:8.2f} GiB  "
                     f"the {min(x.gpus_per_node, x.world)} ranks of a node together")
    if x.delta_base:
        lines.append(f"  {'delta-sync base':<22} {plan.delta_host_bytes / GiB:8.2f} GiB  host "
                     f"memory of rank 0 ({x.delta_base}: " + ("the weights as last sent)"
                     if x.delta_base == "copy" else "64 B digest per tensor)"))
    if plan.delta_server_bytes:
        lines.append(f"  {'delta loader copy':<22} {plan.delta_server_bytes / GiB:8.2f} GiB  "
                     "host memory of every SGLang TP rank (the loader's base)")
    lines.append("")
    if plan.fits:
        lines.append("fits")
    else:
        lines += [f"does not fit: {p}" for p in plan.problems]
        if changes:
            lines.append(changes)
    return "\n".join(lines)
