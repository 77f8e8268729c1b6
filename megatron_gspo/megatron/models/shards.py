"""Full (unsharded) tensors <-> this rank's TP / PP / EP shards, in Megatron parameter naming.

A "full" state dict uses the names of a TP=PP=EP=1 model (`decoder.layers.<global i>...`,
`local_experts.<global j>`, see `megatron_gspo.megatron.models.builder`); tensors have the full
shapes (vocabulary padded). Sharding rules per local parameter:
  - the layer index is shifted by the pipeline stage's (virtual chunk's) layer offset, the
    expert index by ep_rank * experts_per_rank;
  - `tensor_model_parallel` parameters are split along `partition_dim` over the TP group (expert
    parameters over the expert-TP group); gated `linear_fc1` weights hold [gate; up] and are split
    per half so each rank keeps [gate_r; up_r];
  - with tied embeddings and PP > 1, the last stage's `output_layer.weight` is the embedding;
  - TE-spec names map to local-spec names (`canonical_name`), so one full state dict serves
    both specs.
Used to load the same weights into any layout (tests, HF import) and to gather full weights /
gradients back (tests, exports of small models). Gathering uses object all-gather: meant for
tests and small models, not for streaming large checkpoints.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"(local_experts\.)(\d+)(\.)")
_GROUPED = re.compile(r"(experts\.linear_fc[12]\.weight)(\d+)$")


def _is_expert(param, name: str = "") -> bool:
    # routed-expert weights: by name too (with EP = 1 Megatron marks them allreduce=True, yet
    # they split over the expert-TP group, e.g. gpt-oss under TP2 with expert_tensor=1)
    return ".experts." in name or not getattr(param, "allreduce", True)


def _groups(param, name: str = ""):
    from megatron.core import parallel_state as ps

    if _is_expert(param, name):
        return ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size(), \
            ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_tensor_model_parallel_rank()


def global_name(local_name: str, layer_offset: int, expert_offset: int) -> str:
    """Full-model name of a local parameter name."""
    name = _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.",
                      local_name, count=1)
    name = _EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}{m.group(3)}",
                       name)
    return _GROUPED.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}", name)


_TE_TO_LOCAL = (
    (re.compile(r"self_attention\.linear_(q|kv)_up_proj\.layer_norm_weight$"),
     r"self_attention.\1_layernorm.weight"),  # multi-latent attention's latent norms
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
    (re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$"),
     r"mlp.experts.local_experts.\2.\1.weight"),
)


def canonical_name(name: str) -> str:
    """Local-spec name of a (global) parameter name, so TE-spec models (fused layer norms,
    grouped-GEMM experts) share the full-state-dict naming of the local spec."""
    for pattern, repl in _TE_TO_LOCAL:
        name = pattern.sub(repl, name)
    return name


def _is_gated_fc1(name: str, config) -> bool:
    # a LoRA B factor of a gated fc1 has the weight's rows ([gate_r; up_r] per rank); the bias
    # of a gated fc1 (gpt-oss's experts) is [gate; up] too
    return config.gated_linear_unit and ("linear_fc1.weight" in name or "linear_fc1.bias" in name
                                         or name.endswith("linear_fc1.lora_b"))


def _segments(name: str, config, rows: int) -> list[int] | None:
    """Full-size segments of a TP-partitioned tensor whose every segment is split over the
    ranks (a rank holds [seg_1 / tp, seg_2 / tp, ...]), or None for one plain split: a gated
    fc1's [gate; up]; a gated delta-net's in_proj [q; k; v; z; b; a] and conv1d [q; k; v]
    (megatron-core ssm/gated_delta_net.py partitions them per head group)."""
    if _is_gated_fc1(name, config):
        return [rows // 2, rows // 2]
    nv = getattr(config, "linear_num_value_heads", None)
    if nv and ".self_attention." in name:
        qk = config.linear_num_key_heads * config.linear_key_head_dim
        v = nv * config.linear_value_head_dim
        if name.endswith("self_attention.in_proj.weight"):
            return [qk, qk, v, v, nv, nv]
        if name.endswith(("self_attention.conv1d.weight", "self_attention.conv1d.bias")):
            return [qk, qk, v]
    return None


def shard_tensor(full: torch.Tensor, param, name: str, config) -> torch.Tensor:
    """This rank's shard of `full` for `param` (a local model parameter)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    _, size, rank = _groups(param, name)
    dim = param.partition_dim
    segs = _segments(name, config, full.shape[dim])
    if segs:
        return torch.cat([torch.chunk(s, size, dim)[rank]
                          for s in torch.split(full, segs, dim=dim)], dim=dim)
    return torch.chunk(full, size, dim=dim)[rank]


def unshard_tensor(local: torch.Tensor, param, name: str, config) -> torch.Tensor:
    """All-gather a TP (or expert-TP) sharded tensor back to its full shape."""
    if not getattr(param, "tensor_model_parallel", False):
        return local
    group, size, _ = _groups(param, name)
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim = param.partition_dim
    segs = _segments(name, config, local.shape[dim] * size)
    if segs:
        pieces = [torch.split(p, [s // size for s in segs], dim=dim) for p in parts]
        return torch.cat([pieces[r][i] for i in range(len(segs)) for r in range(size)], dim=dim)
    return torch.cat(parts, dim=dim)


def _offsets(chunk, vp_stage):
    from megatron.core import parallel_state as ps

    from megatron_gspo.megatron.models.builder import layer_offset

    cfg = chunk.config
    eo = 0
    if cfg.num_moe_experts:
        eo = ps.get_expert_model_parallel_rank() * (cfg.num_moe_experts
                                                   // ps.get_expert_model_parallel_world_size())
    return layer_offset(cfg, vp_stage), eo


def _named_params(chunks, buffers: bool = True):
    """(local name, full name, tensor, config) of every parameter and, with `buffers`, of the
    buffers that are model weights (the sigmoid router's `expert_bias`, DeepSeek-V3)."""
    for vp, chunk in enumerate(chunks):
        lo, eo = _offsets(chunk, vp if len(chunks) > 1 else None)
        named = list(chunk.named_parameters())
        if buffers:
            named += [(n, b) for n, b in chunk.named_buffers() if n.endswith(".expert_bias")]
        for name, p in named:
            yield name, canonical_name(global_name(name, lo, eo)), p, chunk.config


def load_full_state_dict(chunks: list, full: dict[str, torch.Tensor], tied: bool) -> None:
    """Copy full tensors into the local shards of every model chunk.

    Args:
        chunks: unwrapped GPTModel chunks of this rank.
        full: full-model state dict (see module docstring).
        tied: the model ties input and output embeddings.
    Raises:
        KeyError naming the first missing tensor; ValueError on a shape mismatch.
    """
    with torch.no_grad():
        for local, gname, p, cfg in _named_params(chunks):
            key = gname
            if key not in full and tied and gname == "output_layer.weight":
                key = "embedding.word_embeddings.weight"
            if key not in full and key.endswith((".lora_a", ".lora_b")):
                continue  # LoRA adapters keep their values when a base state dict is loaded
            if key not in full:
                raise KeyError(f"full state dict has no tensor {key!r} (for local {local!r})")
            shard = shard_tensor(full[key], p, local, cfg)
            if shard.shape != p.shape:
                raise ValueError(f"{key}: shard shape {tuple(shard.shape)} != parameter shape "
                                 f"{tuple(p.shape)}")
            p.copy_(shard.to(p.dtype))


def gather_full(chunks: list, tied: bool, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors (parameters, or `main_grad` / `grad` with grads=True) on EVERY rank.

    Args:
        chunks: unwrapped GPTModel chunks (DDP-wrapped models keep `main_grad` on params).
        tied: tied embeddings (the last stage's output_layer copy is skipped).
        grads: gather gradients instead of parameters (needs a non-distributed optimizer's
            all-reduced gradients).
    Returns:
        {full name: float32 CPU tensor}.
    """
    from megatron.core import parallel_state as ps

    mine: dict[str, torch.Tensor] = {}
    for local, gname, p, cfg in _named_params(chunks, buffers=not grads):
        if tied and gname == "output_layer.weight":
            continue
        t = p.detach()
        if grads:
            t = getattr(p, "main_grad", None)
            if t is None:
                t = p.grad if p.grad is not None else torch.zeros_like(p)
        full = unshard_tensor(t.detach().float(), p, local, cfg)
        if _is_expert(p, local):  # one copy per expert-TP group and expert-DP group
            keep = (ps.get_expert_tensor_parallel_rank() == 0
                    and ps.get_expert_data_parallel_rank() == 0)
        else:  # one copy per TP group and DP x CP group
            keep = (ps.get_tensor_model_parallel_rank() == 0
                    and ps.get_data_parallel_rank(with_context_parallel=True) == 0)
        if keep:
            mine[gname] = full.cpu()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict[str, torch.Tensor] = {}
    for d in every:
        out.update(d)
    return out
