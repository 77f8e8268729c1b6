"""Tensor-, pipeline- and expert-parallel sharding of full Megatron-Core tensors.

Pure torch; no process groups. Rules per parameter kind (see `ParamMap`):
- column-parallel (``linear_qkv``, ``linear_fc1``) and vocab (embedding, output layer): dim 0;
- row-parallel (``linear_proj``, ``linear_fc2``): dim 1;
- norms, router: replicated;
- fused ``[gate; up]`` (``glu``) is split per half, so each rank holds ``[gate_r; up_r]``;
- the interleaved QKV splits by query groups, which is a plain dim-0 chunk of the fused tensor;
- a tensor of ``sections`` (the delta-net's in_proj / conv1d) splits each section.
Routed experts are split across EP ranks (contiguous blocks of experts) and, inside an
expert, across the expert-tensor-parallel group with the same rules.
"""

from __future__ import annotations

import re

import torch

from megatron_gspo.convert.param_map import GLU_KINDS, ConversionError, ParamMap

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def tp_shard(full: torch.Tensor, pm: ParamMap, rank: int, size: int) -> torch.Tensor:
    """This rank's tensor-parallel shard of a full tensor.

    Args:
        full: the full Megatron-Core tensor of `pm`.
        pm: its ParamMap (tp_dim, kind).
        rank, size: tensor-parallel (or expert-tensor-parallel) rank and size.
    Returns:
        a contiguous shard (the tensor itself when replicated or size == 1).
    """
    if pm.tp_dim is None or size == 1:
        return full
    dim = pm.tp_dim
    if full.shape[dim] % (2 * size if pm.kind in GLU_KINDS else size):
        raise ConversionError(
            f"{pm.mcore}: dim {dim} of size {full.shape[dim]} does not split over {size} TP ranks"
        )
    if pm.kind in GLU_KINDS:
        gate, up = torch.chunk(full, 2, dim=dim)
        return torch.cat([gate.chunk(size, dim)[rank], up.chunk(size, dim)[rank]], dim=dim)
    if pm.sections:
        if sum(pm.sections) != full.shape[dim] or any(n % size for n in pm.sections):
            raise ConversionError(f"{pm.mcore}: sections {pm.sections} of dim {dim} do not "
                                  f"split over {size} TP ranks")
        parts = torch.split(full, list(pm.sections), dim=dim)
        return torch.cat([p.chunk(size, dim)[rank] for p in parts], dim=dim).contiguous()
    return full.chunk(size, dim)[rank].contiguous()


def tp_unshard(shards: list[torch.Tensor], pm: ParamMap) -> torch.Tensor:
    """Inverse of `tp_shard`: the full tensor from all ranks' shards (in rank order)."""
    if pm.tp_dim is None or len(shards) == 1:
        return shards[0]
    dim = pm.tp_dim
    if pm.kind in GLU_KINDS:
        halves = [torch.chunk(s, 2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    if pm.sections:
        local = [n // len(shards) for n in pm.sections]
        pieces = [torch.split(s, local, dim=dim) for s in shards]
        return torch.cat([p[i] for i in range(len(local)) for p in pieces], dim=dim)
    return torch.cat(shards, dim=dim)


def layer_index(name: str) -> int | None:
    """Decoder layer index in a Megatron-Core name, or None for non-layer parameters."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def expert_index(name: str) -> int | None:
    """Expert index in a canonical expert name, or None."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def rename_indices(name: str, layer: int | None = None, expert: int | None = None) -> str:
    """Replace the layer and/or expert index of a canonical name."""
    if layer is not None:
        name = _LAYER.sub(f"decoder.layers.{layer}.", name, count=1)
    if expert is not None:
        name = _EXPERT.sub(f".experts.local_experts.{expert}.", name, count=1)
    return name


def pp_layer_ranges(num_layers: int, pp_size: int) -> list[range]:
    """Even split of decoder layers over pipeline stages (first stages take the remainder)."""
    if num_layers < pp_size:
        raise ConversionError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    out, start = [], 0
    for r in range(pp_size):
        n = base + (1 if r < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def ep_expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """Global expert indices held by one expert-parallel rank."""
    if num_experts % ep_size:
        raise ConversionError(f"{num_experts} experts do not split over {ep_size} EP ranks")
    n = num_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


def shard_state_dict(
    full: dict[str, torch.Tensor],
    maps: dict[str, ParamMap],
    *,
    tp: tuple[int, int],
    pp: tuple[int, int],
    ep: tuple[int, int],
    etp: tuple[int, int] | None = None,
    num_layers: int,
    num_experts: int = 0,
) -> dict[str, torch.Tensor]:
    """One rank's local state dict (local layer / expert indices) from a full canonical one.

    Args:
        full: canonical name -> full tensor.
        maps: canonical name -> ParamMap.
        tp, pp, ep, etp: (rank, size) for tensor, pipeline, expert and expert-tensor parallelism
            (etp defaults to tp).
        num_layers: decoder layers; num_experts: routed experts per layer (0 = dense).
    Returns:
        local name -> shard, for the parameters this rank owns (embedding on the first stage,
        final norm and output layer on the last).
    """
    etp = etp or tp
    layers = pp_layer_ranges(num_layers, pp[1])[pp[0]]
    experts = ep_expert_range(num_experts, *ep) if num_experts else range(0)
    out = {}
    for name, t in full.items():
        pm = maps[name]
        li = layer_index(name)
        if li is None:
            first, last = pp[0] == 0, pp[0] == pp[1] - 1
            if (name.startswith("embedding.") and not first) or (
                not name.startswith("embedding.") and not last
            ):
                continue
            out[name] = tp_shard(t, pm, *tp)
            continue
        if li not in layers:
            continue
        local = rename_indices(name, layer=li - layers.start)
        if pm.expert:
            e = expert_index(name)
            if e not in experts:
                continue
            out[rename_indices(local, expert=e - experts.start)] = tp_shard(t, pm, *etp)
        else:
            out[local] = tp_shard(t, pm, *tp)
    return out
