"""Per-GPU memory plan of a colocated (or disaggregated) run, from numbers alone.

What the learner holds on one rank, as megatron-core 0.16.1 lays it out (the functions below
take sizes, not the config; `megatron_gspo.megatron.memory.report` builds the inputs from a
config and prints the table):

- weights: the model parameters in `params_dtype`. With the distributed optimizer, DDP maps
  every parameter into one contiguous buffer per (param dtype, grad dtype) whose parameter
  starts are padded to 64 elements and whose end is padded to lcm(DP, 128) (a parameter tagged
  `shared_embedding`, the tied embedding copy under PP > 1, gets a bucket of its own);
  without it parameters keep their own tensors (no padding).
- gradients: the DDP gradient buffer, the same element count as the parameter buffer, in fp32
  (`grad_reduce_in_fp32=True`, `megatron.optimizer.wrap_ddp`): 4 bytes per element.
- main weights: fp32 copies of bf16 / fp16 parameters (none for fp32 parameters); with the
  distributed optimizer only this DP rank's slice of each bucket.
- moments: Adam's exp_avg and exp_avg_sq, fp32, one each per main weight (for fp32 models,
  per parameter, sharded alike).
- expert parameters (EP > 1, `allreduce=False`) have their own buffer, sharded over the
  expert-data-parallel group (TP x CP x DP / (EP x ETP) ranks).

SGLang 0.5.12 sizes its KV cache when a server starts (model_runner_kv_cache_mixin.py,
`profile_max_num_token`): with `free` the memory free on the GPU before it loads the model
(the learner's resident memory already subtracted) and `f` = `--mem-fraction-static`,

    rest = (free - weights) - free * (1 - f) = free * f - weights
    kv_tokens = rest // cell,  cell = max(1, kv_heads // tp) * 2 * head_dim * layers * 2 bytes

so `f` is a share of the memory free at launch, weights included; CUDA graphs and the
server's activations live in the other `free * (1 - f)`.

A hybrid linear-attention model (Qwen3.5, Qwen3-Next; `Dims.linear`) has its layer
parameters, activations and SGLang 0.5.23 pools (KV of the full-attention layers only, a
delta-net state per request slot) in `megatron.memory.hybrid` / `runtime.sglang_pools`.

Activation and logits terms are estimates (see `activation_bytes`); the CUDA-graph and
per-process context terms are fixed allowances, not measurements.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megatron_gspo.convert.param_map import num_routed_experts
from megatron_gspo.megatron.memory import hybrid
from megatron_gspo.runtime.device_ledger import sglang_kv_tokens  # noqa: F401 - SGLang's KV sizing

GiB = 2**30


@dataclass(frozen=True)
class Dims:
    """Transformer sizes (from a Hugging Face config)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    context_len: int = 0  # max_position_embeddings (SGLang's default context length)
    # hybrid linear-attention models (`megatron.memory.hybrid`): per layer, gated delta-net
    # (True) or gated full attention; empty for every other model
    linear: tuple[bool, ...] = ()
    lk_heads: int = 0
    lv_heads: int = 0
    lk_dim: int = 0
    lv_dim: int = 0
    conv: int = 0
    shared_ffn: int = 0
    ssm_dtype: str = "float32"


def dims_from_hf(hf: dict) -> Dims:
    """`Dims` of a Qwen2/3 / Llama-style (MoE: Qwen3-MoE) config.json dict, or of a hybrid
    (Qwen3.5, Qwen3-Next: `megatron.memory.hybrid`)."""
    h, nh = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return Dims(hidden=h, layers=int(hf["num_hidden_layers"]), heads=nh,
                kv_heads=int(hf.get("num_key_value_heads") or nh),
                head_dim=int(hf.get("head_dim") or h // nh),
                ffn=int(hf.get("intermediate_size") or 0), vocab=int(hf["vocab_size"]),
                tied=bool(hf.get("tie_word_embeddings", False)),
                experts=num_routed_experts(hf),
                topk=int(hf.get("num_experts_per_tok") or 0),
                expert_ffn=int(hf.get("moe_intermediate_size") or 0),
                context_len=int(hf.get("max_position_embeddings") or 0),
                **(hybrid.hybrid_fields(hf) if hybrid.is_hybrid(hf) else {}))


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Embedding rows: `vocab` rounded up to a multiple of lcm(multiple, tp)."""
    m = math.lcm(multiple, tp)
    return -(-vocab // m) * m


@dataclass(frozen=True)
class Param:
    numel: int
    expert: bool = False  # in the expert-parallel buffer (EP > 1)
    shared: bool = False  # `shared_embedding`: a bucket of its own (distributed optimizer)
    trainable: bool = True  # False: a LoRA-frozen weight (no DDP buffer, no optimizer state)
    replicated: bool = False  # the same on every TP rank (norms, router): TP rank 0 saves it
    halves: bool = False  # a SwiGLU fc1 (gate; up): saved as two tensors (swiglu factory)


def _param(numel: int, kind: str, ep: int) -> Param:
    """A `Param` of `megatron.memory.hybrid`'s (elements, kind)."""
    expert = kind.startswith("expert") and ep > 1
    return Param(numel, expert=expert, replicated=kind == "rep",
                 halves=kind.endswith("halves"))


def chunk_params(d: Dims, *, tp: int, pp: int, ep: int, etp: int, vpp: int, pp_rank: int,
                 vp_stage: int, vocab_multiple: int = 128,
                 lora: tuple[int, tuple[str, ...]] | None = None) -> list[Param]:
    """This rank's parameters of one model chunk, in module order (local or TE spec: the
    counts agree, TE fuses each norm into the next linear). `lora` = (rank, targets): every
    weight frozen, the adapter factors of `megatron.lora.adapters` appended as the trainable
    ones."""
    n_chunks = pp * vpp
    if d.layers % n_chunks:
        raise ValueError(f"{d.layers} layers do not split over PP {pp} x VPP {vpp}")
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == pp - 1 and vp_stage == vpp - 1
    h, hd = d.hidden, d.head_dim
    v = padded_vocab(d.vocab, tp, vocab_multiple)
    out: list[Param] = []
    if first:
        out.append(Param(v * h // tp, shared=d.tied and pp > 1))
    per_chunk = d.layers // n_chunks
    start = (vp_stage * pp + pp_rank) * per_chunk  # Megatron's layer offset of this chunk
    for i in range(start, start + per_chunk):
        if d.linear:
            out += [_param(n, k, ep) for n, k in hybrid.layer_numels(d, i, tp=tp, ep=ep, etp=etp)]
            continue
        out += [Param(h, replicated=True), Param(h * d.heads * hd // tp),
                Param((d.heads + 2 * d.kv_heads) * hd * h // tp), Param(hd, replicated=True),
                Param(hd, replicated=True), Param(h, replicated=True)]
        if d.experts:
            out.append(Param(d.experts * h, replicated=True))  # router
            for _ in range(d.experts // ep):
                out += [Param(2 * d.expert_ffn * h // etp, expert=ep > 1, halves=True),
                        Param(d.expert_ffn * h // etp, expert=ep > 1)]
        else:
            out += [Param(2 * d.ffn * h // tp, halves=True), Param(d.ffn * h // tp)]
    if last:
        out.append(Param(h, replicated=True))
        if not d.tied or pp > 1:
            out.append(Param(v * h // tp, shared=d.tied and pp > 1))
    if lora is None:
        return out
    r, targets = lora
    frozen = [dataclasses.replace(p, trainable=False) for p in out]
    if d.linear:
        return frozen + [_param(n, k, ep) for i in range(start, start + per_chunk)
                         for n, k in hybrid.lora_numels(d, i, r, targets, tp=tp, ep=ep, etp=etp)]
    per_layer: list[Param] = []  # (A, B) per adapted linear: column B / row A split by TP,
    # the other factor the same on every TP rank
    shapes = {"qkv": (h, (d.heads + 2 * d.kv_heads) * hd // tp),
              "proj": (d.heads * hd // tp, h), "fc1": (h, 2 * d.ffn // tp),
              "fc2": (d.ffn // tp, h)}
    for t in ("qkv", "proj") + (() if d.experts else ("fc1", "fc2")):
        if t in targets:
            column = t in ("qkv", "fc1")
            per_layer += [Param(r * shapes[t][0], replicated=column),
                          Param(shapes[t][1] * r, replicated=not column, halves=t == "fc1")]
    if d.experts and "experts" in targets:
        for _ in range(d.experts // ep):
            per_layer += [Param(r * h, expert=ep > 1),
                          Param(2 * d.expert_ffn // etp * r, expert=ep > 1),
                          Param(r * d.expert_ffn // etp, expert=ep > 1),
                          Param(h * r, expert=ep > 1)]
    return frozen + per_layer * (d.layers // n_chunks)


def buffer_ranges(numels: list[int], shared: list[bool], dp: int,
                  distributed: bool) -> tuple[int, list[tuple[int, int]], list[tuple[int, int]]]:
    """Megatron's `_ParamAndGradBuffer` layout of parameters given in module order.

    Returns:
        (buffer elements incl. padding, [(start, end)] per parameter, [(start, end)] per bucket).
    """
    if not distributed:
        spans, pos = [], 0
        for n in reversed(numels):
            spans.append((pos, pos + n))
            pos += n
        return pos, spans[::-1], [(0, pos)]
    div = math.lcm(dp, 128)
    spans: list[tuple[int, int]] = []
    buckets: list[tuple[int, int]] = []
    pos = bucket_start = 0
    n_in_bucket = 0

    def close(end: int) -> int:
        nonlocal bucket_start, n_in_bucket
        end = -(-end // div) * div
        buckets.append((bucket_start, end))
        bucket_start, n_in_bucket = end, 0
        return end

    for n, sh in zip(reversed(numels), reversed(shared), strict=True):
        pos = -(-pos // 64) * 64
        if sh and n_in_bucket:
            pos = close(pos)
        spans.append((pos, pos + n))
        n_in_bucket += 1
        pos += n
        if sh:
            pos = close(pos)
    if n_in_bucket:
        pos = close(pos)
    return pos, spans[::-1], buckets


def shard_elements(spans: list[tuple[int, int]], buckets: list[tuple[int, int]], dp: int,
                   dp_rank: int) -> int:
    """Parameter elements (padding excluded) in DP rank `dp_rank`'s slice of every bucket."""
    total = 0
    for b0, b1 in buckets:
        size = (b1 - b0) // dp
        lo, hi = b0 + dp_rank * size, b0 + (dp_rank + 1) * size
        total += sum(max(0, min(e, hi) - max(s, lo)) for s, e in spans if s < b1 and e > b0)
    return total


@dataclass(frozen=True)
class LearnerBytes:
    weights: int
    grads: int
    main: int
    moments: int
    reference: int = 0

    @property
    def state(self) -> int:
        return self.grads + self.main + self.moments

    @property
    def total(self) -> int:
        return self.weights + self.state + self.reference


def learner_bytes(d: Dims, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                  vpp: int = 1, dp: int = 1, cp: int = 1, distributed: bool = False,
                  param_bytes: int = 2, pp_rank: int = 0, dp_rank: int = 0,
                  edp_rank: int = 0, reference: bool = False,
                  vocab_multiple: int = 128,
                  lora: tuple[int, tuple[str, ...]] | None = None) -> LearnerBytes:
    """Bytes of one rank's weights, fp32 gradient buffer, main weights, Adam moments and (when
    `reference`) the frozen KL reference (same layout, `param_bytes`, no DDP buffer).

    `dp` is the data-parallel size without CP; DDP shards over DP x CP ranks (`dp_rank` is this
    rank's index there, `edp_rank` its index in the expert-data-parallel group). With `lora`
    (rank, targets) the frozen weights keep plain tensors and the DDP buffer, main weights
    and moments cover the adapters only; the KL reference is the base itself (0 bytes).
    """
    etp = tp if etp is None else etp
    dense_dp = dp * cp
    expert_dp = tp * cp * dp // (ep * etp)
    weights = grads = main = moments = ref = 0
    main_bytes = 4 if param_bytes != 4 else 0
    for vp in range(vpp):
        ps = chunk_params(d, tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, pp_rank=pp_rank,
                          vp_stage=vp, vocab_multiple=vocab_multiple, lora=lora)
        ref += 0 if lora else sum(p.numel for p in ps) * param_bytes
        weights += sum(p.numel for p in ps if not p.trainable) * param_bytes
        for expert, group, rank in ((False, dense_dp, dp_rank), (True, expert_dp, edp_rank)):
            sel = [p for p in ps if p.expert == expert and p.trainable]
            if not sel:
                continue
            numel, spans, buckets = buffer_ranges([p.numel for p in sel],
                                                  [p.shared for p in sel], group, distributed)
            grads += numel * 4
            weights += (numel if distributed else sum(p.numel for p in sel)) * param_bytes
            mine = shard_elements(spans, buckets, group, rank) if distributed else \
                sum(p.numel for p in sel)
            main += mine * main_bytes
            moments += mine * 8
    return LearnerBytes(weights=weights, grads=grads, main=main, moments=moments,
                        reference=ref if reference else 0)


def activation_bytes(d: Dims, *, tokens: int, layers: int, tp: int = 1, sp: bool = False,
                     cp: int = 1, etp: int | None = None, recompute: bool = False,
                     in_flight: int = 1, act_bytes: int = 2) -> int:
    """Estimated activation memory kept for the backward pass on one rank.

    Per token and layer (bf16, flash attention, no dropout): norm inputs and outputs, the QKV
    and attention outputs, the MLP input, its fc1 output and the SwiGLU product (MoE: the
    top-k dispatched copies through the experts); the parts outside the TP region divide by TP
    only with sequence parallelism. Full recompute keeps each layer's input and one layer's
    whole set. `in_flight` micro-batches are alive at once (the first pipeline stage keeps up
    to PP of them under 1F1B).
    """
    etp = tp if etp is None else etp
    t = -(-tokens // cp)
    h, hd = d.hidden, d.head_dim
    if d.linear:  # the stage's share of delta-net layers, the largest layer under recompute
        gdn, full = hybrid.layer_activation_elements(d, tp=tp, sp=sp, etp=etp)
        n_lin = round(layers * sum(d.linear) / len(d.linear))
        if recompute:
            kept = layers * h * act_bytes // (tp if sp else 1) + max(gdn, full) * act_bytes
        else:
            kept = (n_lin * gdn + (layers - n_lin) * full) * act_bytes
        return int(t * kept * in_flight)
    outside = 4 * h // (tp if sp else 1)  # two norm inputs + two norm outputs
    attn = (2 * (d.heads + 2 * d.kv_heads) * hd + 2 * d.heads * hd) // tp  # qkv, q/k norm, out
    if d.experts:
        mlp = d.topk * (h + 3 * d.expert_ffn // etp) + d.experts // tp
    else:
        mlp = 3 * d.ffn // tp + h // (tp if sp else 1)
    per_layer = (outside + attn + mlp + 2 * h) * act_bytes  # + the residuals
    if recompute:
        kept = layers * h * act_bytes // (tp if sp else 1) + per_layer
    else:
        kept = layers * per_layer
    return int(t * kept * in_flight)


def logits_bytes(tokens: int, vocab_local: int, cp: int = 1) -> int:
    """The last stage's vocab-parallel logits: bf16 output plus two fp32 copies (log-softmax
    and its gradient) per token."""
    return -(-tokens // cp) * vocab_local * (2 + 4 + 4)


def kv_cell_bytes(d: Dims, tp: int, kv_bytes: int = 2) -> int:
    """SGLang's `get_cell_size_per_token` for an MHA/GQA model: bytes of one token's K and V
    over all layers on one TP rank (a hybrid: its full-attention layers only, SGLang 0.5.23's
    `DefaultPoolConfigurator`)."""
    return max(1, d.kv_heads // tp) * 2 * d.head_dim * (d.layers - sum(d.linear)) * kv_bytes


def mem_fraction_for(free_bytes: int, weight_bytes: int, kv_tokens: int,
                     cell_bytes: int) -> float:
    """The `--mem-fraction-static` that gives `kv_tokens` tokens of KV cache (inverse of
    `sglang_kv_tokens`)."""
    return (weight_bytes + kv_tokens * cell_bytes) / free_bytes


@dataclass
class Plan:
    """Rows (name, bytes, note) and moments (name, bytes) of one GPU; see `fits`."""

    gpu_bytes: int
    rows: list[tuple[str, int, str]] = field(default_factory=list)
    moments: list[tuple[str, int, list[str]]] = field(default_factory=list)
    kv_tokens: int | None = None
    kv_tokens_needed: int = 0
    state_slots: int | None = None  # a hybrid's SGLang delta-net state slots per server rank
    max_running_requests: int | None = None  # ... and the requests they serve at once
    host_bytes: int = 0  # pinned host memory of one rank: offloaded learner + staging copy
    staging_bytes: int = 0  # of which Megatron-Core's checkpoint staging copy (`staging`)
    node_host_bytes: int = 0  # the same summed over the ranks of one node (the largest node)
    delta_host_bytes: int = 0  # rank 0's delta-sync base (rollout.weight_sync_delta_base)
    delta_server_bytes: int = 0  # the delta loader's copy in each SGLang TP rank's host memory
    problems: list[str] = field(default_factory=list)

    def term(self, name: str) -> int:
        return next(b for n, b, _ in self.rows if n == name)

    @property
    def fits(self) -> bool:
        return not self.problems

    def biggest(self, moment: str) -> str:
        """The largest row in a moment, as 'name X.X GiB'."""
        parts = next(p for n, _, p in self.moments if n == moment)
        name = max(parts, key=self.term)
        return f"{name} {self.term(name) / GiB:.1f} GiB"

    def check(self) -> None:
        for name, total, _parts in self.moments:
            if total > self.gpu_bytes:
                self.problems.append(
                    f"{name}: {total / GiB:.1f} GiB > {self.gpu_bytes / GiB:.1f} GiB per GPU "
                    f"(biggest term: {self.biggest(name)})")
        if self.kv_tokens is not None and self.kv_tokens < self.kv_tokens_needed:
            self.problems.append(
                f"SGLang KV cache: {self.kv_tokens} tokens < {self.kv_tokens_needed} (one "
                "longest prompt + response per server)")
