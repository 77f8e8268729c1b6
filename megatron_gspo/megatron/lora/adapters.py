"""LoRA adapters (Hu et al., arXiv 2106.09685) on the learner's Megatron-Core linear layers.

A targeted linear layer W (frozen) gets two trainable factors, A [r, in] and B [out, r], and
computes y = W x + (alpha / r) * B A dropout(x). B starts at zero, so step 0 is the base model.

Targets (`TARGETS`): `qkv` (self_attention.linear_qkv), `proj` (self_attention.linear_proj),
`fc1` / `fc2` (dense mlp.linear_fc1 / linear_fc2), `experts` (linear_fc1 and linear_fc2 of
every routed expert of a SequentialMLP, the local spec's experts) and `shared_experts`
(mlp.shared_experts.linear_fc1 / linear_fc2 of DeepSeek-V3 / GLM-4.5-style MoE layers: a
SharedExpertMLP is a dense MLP on the tensor-parallel group, adapted like `fc1` / `fc2`).
The fused QKV and [gate; up] layers carry ONE adapter each (A shared by q, k and v, B with
the fused layer's rows): a PEFT export writes it as per-projection adapters of the same rank
(the same A for each, B cut like the weight), which is exact.

Tensor parallelism (the factors are sharded like their base layer):
  - column-parallel base (qkv, fc1): A [r, in] replicated, B [out/tp, r] split on the output;
    h = A x is made whole across TP by `copy_to_tensor_model_parallel_region` (backward:
    all-reduce of dh, so dA is complete on every rank); with sequence parallelism x is a
    sequence shard, h is all-gathered along the sequence and dA (partial over the sequence)
    is all-reduced over TP by Megatron's finalize step (`sequence_parallel` attribute);
  - row-parallel base (proj, fc2): A [r, in/tp] split on the input, B [out, r] replicated; the
    partial h = A_i x_i is reduced like the base's output (all-reduce, or reduce-scatter along
    the sequence under sequence parallelism, where dB is then all-reduced like above);
  - routed experts: expert-tensor parallelism 1 (the dispatcher's communication wraps the
    expert layers); adapter gradients are reduced like their weight's (`allreduce`: False,
    over the expert-data-parallel group, for expert weights under EP > 1).
Adapter parameters carry Megatron's `tensor_model_parallel` / `partition_dim` attributes, so
the learner's full-state-dict gather / load and Megatron's grad-norm treat them like weights.

Merged weights (`effective_weight`): W + (alpha / r) * B A per TP shard, the same layout as W,
for weight sync and the merged export. `adapters_off` runs the base model (the KL reference).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TARGETS = ("qkv", "proj", "fc1", "fc2", "experts", "shared_experts")
_COLUMN = ("qkv", "fc1", "experts.fc1", "shared_experts.fc1")


class LoraError(ValueError):
    """A LoRA setting or model this module cannot serve."""


@dataclass(frozen=True)
class LoraSettings:
    """rank r, alpha (scale = alpha / r), dropout on the adapter's input, targeted layers."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")

    def __post_init__(self):
        bad = [t for t in self.targets if t not in TARGETS]
        if bad:
            raise LoraError(f"model.lora.targets: unknown target {bad[0]!r}; known: "
                            f"{', '.join(TARGETS)}")
        if self.rank < 1 or not self.targets:
            raise LoraError("model.lora: needs rank >= 1 and at least one target")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"model.lora.dropout: {self.dropout} not in [0, 1)")

    @property
    def scale(self) -> float:
        return float(self.alpha) / float(self.rank)


def target_of(name: str) -> str | None:
    """The target kind of a module name of a GPTModel chunk (None: not a LoRA target):
    "experts.grouped" for the TE spec's grouped-GEMM experts (Megatron-Core 0.16.1
    transformer/moe/experts.py: TEGroupedMLP's `mlp.experts.linear_fc1` / `linear_fc2`)."""
    if ".experts.local_experts." in name:
        if name.endswith(".linear_fc1"):
            return "experts.fc1"
        return "experts.fc2" if name.endswith(".linear_fc2") else None
    if name.endswith((".mlp.experts.linear_fc1", ".mlp.experts.linear_fc2")):
        return "experts.grouped"
    for suffix, kind in ((".mlp.shared_experts.linear_fc1", "shared_experts.fc1"),
                         (".mlp.shared_experts.linear_fc2", "shared_experts.fc2"),
                         (".self_attention.linear_qkv", "qkv"),
                         (".self_attention.linear_proj", "proj"),
                         (".mlp.linear_fc1", "fc1"), (".mlp.linear_fc2", "fc2")):
        if name.endswith(suffix):
            return kind
    return None


class _Info:
    """What the forward hook of one adapted layer needs."""

    def __init__(self, kind: str, scale: float, dropout: float, expert: bool, group,
                 size: int, sequence_parallel: bool, norm_eps: float | None):
        self.kind, self.scale, self.dropout, self.expert = kind, scale, dropout, expert
        self.group, self.size, self.sp, self.norm_eps = group, size, sequence_parallel, norm_eps
        self.enabled = True


def _column(kind: str) -> bool:
    return kind in _COLUMN


def _hook(module, args, output):
    info: _Info = module.lora_info
    if not info.enabled:
        return output
    from megatron.core.tensor_parallel import mappings as mp

    x = args[0]
    if info.norm_eps is not None:  # TE's fused norm + linear sees the un-normed input
        x = F.rms_norm(x, (x.shape[-1],), module.layer_norm_weight, info.norm_eps)
    if info.dropout > 0:
        x = F.dropout(x, info.dropout, training=module.training)
    h = F.linear(x, module.lora_a)  # [s, b, r]
    if info.size > 1 and not info.expert:
        if _column(info.kind):
            h = (mp.gather_from_sequence_parallel_region(h, group=info.group) if info.sp
                 else mp.copy_to_tensor_model_parallel_region(h, group=info.group))
        else:
            h = (mp.reduce_scatter_to_sequence_parallel_region(h, group=info.group) if info.sp
                 else mp.reduce_from_tensor_model_parallel_region(h, group=info.group))
    delta = F.linear(h, module.lora_b) * info.scale  # [s, b, out(/tp)]
    out, bias = output
    return out + delta.to(out.dtype), bias


def _seeded(name: str, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed((zlib.crc32(name.encode()) ^ int(seed)) & 0x7FFFFFFF)


def _init_a(full_shape, name: str, seed: int) -> torch.Tensor:
    """Kaiming-uniform (a = sqrt(5), PEFT's default) of the FULL A, seeded by its global name:
    the same adapters in every parallel layout."""
    fan_in = full_shape[1]
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform with a=sqrt(5): sqrt(6/((1+5) fan_in))
    g = _seeded(name, seed)
    return (torch.rand(full_shape, generator=g, dtype=torch.float64) * 2 - 1) * bound


def adapted_modules(chunk) -> list[tuple[str, torch.nn.Module]]:
    """(module name, module) of every adapted layer of one chunk."""
    return [(n, m) for n, m in chunk.named_modules() if hasattr(m, "lora_info")]


def attach(chunks: list, settings: LoraSettings, seed: int = 1234) -> int:
    """Add adapters to the targeted layers of every (unwrapped) chunk and freeze all other
    parameters. Call before DDP wrapping and the optimizer (they then hold the adapters only).

    Args:
        chunks: this rank's GPTModel chunks.
        settings: LoraSettings.
        seed: initialisation seed of the A factors.
    Returns:
        number of layers adapted on this rank.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from megatron_gspo.megatron.models import shards as weights

    if "experts" in settings.targets and any(
            target_of(n) == "experts.grouped" for c in chunks for n, _ in c.named_modules()):
        raise LoraError("model.lora.targets: 'experts' on grouped-GEMM experts of the "
                        "Transformer Engine spec is not supported (TEGroupedMLP's "
                        "TEGroupedLinear: one weight<e> per local expert in one CUDA grouped "
                        "GEMM, forward(x, m_splits); no adapter written, it needs a GPU to "
                        "check); use model.transformer_impl=local")
    count = 0
    seen: set[str] = set()
    for vp, chunk in enumerate(chunks):
        cfg = chunk.config
        lo, eo = weights._offsets(chunk, vp if len(chunks) > 1 else None)
        for p in chunk.parameters():
            p.requires_grad_(False)
        for name, m in list(chunk.named_modules()):
            kind = target_of(name)
            if kind is None or kind.split(".")[0] not in settings.targets:
                continue
            if not hasattr(m, "weight") or m.weight is None:
                raise LoraError(f"model.lora: {name} has no weight to adapt")
            if kind.startswith("shared_experts") and getattr(cfg, "moe_shared_expert_overlap",
                                                             False):
                raise LoraError("model.lora: shared-expert adapters with "
                                "moe_shared_expert_overlap are not supported (its fc1 / fc2 "
                                "run with their own communication outside the TP regions)")
            expert = kind.startswith("experts.")
            if expert:
                group, size = (ps.get_expert_tensor_parallel_group(),
                               ps.get_expert_tensor_parallel_world_size())
                if size > 1:
                    raise LoraError("model.lora: expert adapters need parallel.expert_tensor=1")
            else:
                group, size = (ps.get_tensor_model_parallel_group(),
                               ps.get_tensor_model_parallel_world_size())
            w = m.weight
            column = _column(kind)
            out_local, in_local = w.shape
            full_in = in_local * (1 if column else size)
            gname = weights.global_name(f"{name}.lora_a", lo, eo)
            a_full = _init_a((settings.rank, full_in), gname, seed)
            rank = torch.distributed.get_rank(group) if size > 1 else 0
            a = a_full if column else torch.chunk(a_full, size, dim=1)[rank]
            m.lora_a = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
            m.lora_b = torch.nn.Parameter(torch.zeros(out_local, settings.rank, device=w.device,
                                                      dtype=w.dtype))
            split, dim = (m.lora_b, 0) if column else (m.lora_a, 1)
            set_tensor_model_parallel_attributes(split, size > 1, dim, 1)
            other = m.lora_a if column else m.lora_b
            set_tensor_model_parallel_attributes(other, False, -1, 1)
            sp = bool(cfg.sequence_parallel) and not expert and size > 1
            for p in (m.lora_a, m.lora_b):
                # reduced like the base weight: expert weights under EP > 1 over the
                # expert-data-parallel group (`allreduce=False`), all others over DP
                p.allreduce = getattr(w, "allreduce", True)
                p.sequence_parallel = sp and p is other  # grads partial over the sequence
            norm_eps = None
            if hasattr(m, "layer_norm_weight"):  # TELayerNormColumnParallelLinear
                if cfg.normalization != "RMSNorm":
                    raise LoraError("model.lora: fused LayerNorm inputs are not supported")
                norm_eps = float(cfg.layernorm_epsilon)
            m.lora_info = _Info(kind, settings.scale, settings.dropout, expert, group, size, sp,
                                norm_eps)
            w.lora_module = m  # `effective_weight` finds the adapter from the weight
            m.register_forward_hook(_hook)
            seen.add(kind.split(".")[0])
            count += 1
    missing = [t for t in settings.targets if t not in seen]
    if missing and any(c.decoder is not None and len(c.decoder.layers) for c in chunks):
        raise LoraError(f"model.lora.targets: {missing[0]!r} matches no layer of this model "
                        "(dense models have no experts; MoE layers have no dense fc1 / fc2; "
                        "only DeepSeek-V3 / GLM-4.5-style MoE layers have shared experts)")
    return count


def enabled(chunks: list) -> bool:
    """True when any chunk carries adapters."""
    return any(adapted_modules(c) for c in chunks)


@contextlib.contextmanager
def adapters_off(chunks: list):
    """Run the base model (every adapter bypassed) inside the block."""
    infos = [m.lora_info for c in chunks for _, m in adapted_modules(c)]
    before = [i.enabled for i in infos]
    for i in infos:
        i.enabled = False
    try:
        yield
    finally:
        for i, b in zip(infos, before, strict=True):
            i.enabled = b


def is_adapter_name(name: str) -> bool:
    """True for the parameter names `attach` adds."""
    return name.endswith((".lora_a", ".lora_b"))


@torch.no_grad()
def effective_weight(param: torch.Tensor) -> torch.Tensor:
    """The weight a layer computes with: base + scale * B A for an adapted layer's weight
    (this rank's shard, the weight's dtype and layout), the parameter itself otherwise."""
    m = getattr(param, "lora_module", None)
    if m is None or not m.lora_info.enabled:  # inside `adapters_off`: the base weight
        return param.detach()
    info = m.lora_info
    delta = (m.lora_b.float() @ m.lora_a.float()) * info.scale  # [out(/tp), in(/tp)]
    return (param.float() + delta).to(param.dtype)


def is_adapted_weight(param: torch.Tensor) -> bool:
    """True for the weight of an adapted layer."""
    return getattr(param, "lora_module", None) is not None


def changed_since_sync(param: torch.Tensor) -> bool:
    """True when the adapter of this adapted weight differs from what `mark_synced` recorded
    (or nothing was recorded): its merged weight must travel in a partial sync."""
    m = param.lora_module
    snap = getattr(m, "lora_synced", None)
    return snap is None or not (torch.equal(snap[0], m.lora_a) and torch.equal(snap[1], m.lora_b))


@torch.no_grad()
def mark_synced(params) -> None:
    """Record the adapters of these adapted weights as the engine's (after a sync sent them)."""
    for p in params:
        m = p.lora_module
        m.lora_synced = (m.lora_a.detach().clone(), m.lora_b.detach().clone())


def adapter_parameters(chunks: list) -> list[tuple[str, torch.nn.Parameter]]:
    """(local name, parameter) of every adapter factor of this rank."""
    return [(f"{c}:{n}", p) for c, chunk in enumerate(chunks)
            for n, p in chunk.named_parameters() if is_adapter_name(n)]


def sharded_state_dict(chunks: list) -> dict:
    """Megatron `dist_checkpointing` entries of every adapter factor (and nothing else), keyed
    by global name: they reshard on load into any TP / PP / EP layout, and the optimizer's
    sharded state dict maps its adapter state onto them."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    from megatron_gspo.megatron.models import shards as weights

    out = {}
    for vp, chunk in enumerate(chunks):
        lo, eo = weights._offsets(chunk, vp if len(chunks) > 1 else None)
        for name, m in adapted_modules(chunk):
            info: _Info = m.lora_info
            if info.expert:
                dp_rank, tp_rank = ps.get_expert_data_parallel_rank(), 0
            else:
                dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
                tp_rank = ps.get_tensor_model_parallel_rank()
            for factor in ("lora_a", "lora_b"):
                p = getattr(m, factor)
                key = weights.global_name(f"{name}.{factor}", lo, eo)
                if getattr(p, "tensor_model_parallel", False):
                    sh = ShardedTensor.from_rank_offsets(
                        key, p, (p.partition_dim, tp_rank, info.size),
                        replica_id=(0, 0, dp_rank))
                else:
                    sh = ShardedTensor.from_rank_offsets(key, p, replica_id=(0, tp_rank, dp_rank))
                if factor == "lora_b" and info.kind in ("fc1", "shared_experts.fc1") \
                        and chunk.config.gated_linear_unit:
                    sh = apply_swiglu_sharded_factory(sh, ())  # rows [gate_r; up_r] per rank
                out[key] = sh
    return out


@torch.no_grad()
def load_sharded(chunks: list, loaded: dict) -> None:
    """Copy what `dist_checkpointing.load` returned for `sharded_state_dict` into the
    adapters (KeyError naming a missing factor)."""
    from megatron_gspo.megatron.models import shards as weights

    for vp, chunk in enumerate(chunks):
        lo, eo = weights._offsets(chunk, vp if len(chunks) > 1 else None)
        for name, m in adapted_modules(chunk):
            for factor in ("lora_a", "lora_b"):
                key = weights.global_name(f"{name}.{factor}", lo, eo)
                if key not in loaded:
                    raise KeyError(f"LoRA checkpoint has no adapter tensor {key!r}")
                p = getattr(m, factor)
                if loaded[key] is not p:
                    p.copy_(loaded[key])
