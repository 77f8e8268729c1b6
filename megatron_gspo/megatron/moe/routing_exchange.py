"""The data-parallel exchange of MoE routing records (`router_replay.RoutingReplay.end`).

After a recorded forward each data-parallel rank holds the routing of the samples it routed;
every rank needs every sample's record (later passes re-plan which rank runs which sample).
Only the owned samples' rows of this pipeline stage's layers travel, never a dense
[B, T, layers, k] record, and the collectives use tensors on the device the group's backend
takes (CUDA for NCCL groups on a GPU machine, CPU for gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_rows(rows: dict[int, torch.Tensor], lens: list[int], here: list[int],
                  num_layers: int, topk: int, num_experts: int,
                  group) -> dict[int, torch.Tensor]:
    """Every data-parallel rank's routing rows of the samples it routed, on every DP rank.

    Args:
        rows: {sample index: [T, L, k] expert ids (-1: not routed)} of this rank's samples.
        lens: tokens of every sample of the batch (the same list on every DP rank).
        here: this rank's layers (the same on every rank of `group`: one pipeline stage).
        num_layers, topk, num_experts: router sizes; group: the data-parallel group.
    Returns:
        {sample index: [T, L, k]} of every sample some rank of `group` routed.

    Only the owned samples' rows of this rank's layers travel (one byte per id when the
    expert ids fit), on the device of the groups' backend (NCCL groups need CUDA tensors): one
    all-gather of the owner masks, one of the padded payloads."""
    L, k = num_layers, topk
    n_dp = dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    # uint8 (expert id + 1, 0 = not routed) when the ids fit; NCCL and gloo have no int16
    small = num_experts < 255
    wire, shift = (torch.uint8, 1) if small else (torch.int32, 0)
    mine = torch.zeros(len(lens), dtype=torch.uint8)
    mine[list(rows)] = 1
    masks = [torch.empty_like(mine, device=dev) for _ in range(n_dp)]
    dist.all_gather(masks, mine.to(dev), group=group)
    owned = [m.cpu().bool() for m in masks]  # [dp][B]
    per_tok = len(here) * k
    sizes = [int(sum(lens[si] for si in torch.nonzero(o).flatten().tolist())) * per_tok
             for o in owned]
    width = max(sizes)
    if width == 0:
        return rows
    mine_ids = torch.nonzero(owned[dist.get_rank(group)]).flatten().tolist()
    payload = torch.zeros(width, dtype=wire)
    if mine_ids:
        flat = (torch.cat([rows[si][:, here].reshape(-1) for si in mine_ids]) + shift).to(wire)
        payload[:flat.numel()] = flat
    parts = [torch.empty(width, dtype=wire, device=dev) for _ in range(n_dp)]
    dist.all_gather(parts, payload.to(dev), group=group)
    out, taken = {}, set()
    here_t = torch.tensor(here)
    for r in range(n_dp):
        part, at = parts[r].cpu(), 0
        for si in torch.nonzero(owned[r]).flatten().tolist():
            n = lens[si] * per_tok
            if si not in taken:  # the first owner's rows
                row = torch.full((lens[si], L, k), -1, dtype=torch.int32)
                got = part[at:at + n].view(lens[si], len(here), k).to(torch.int32) - shift
                row[:, here_t] = got
                out[si] = row
                taken.add(si)
            at += n
    return out


def moe_layer_indices(moe_layer_freq, num_layers: int) -> list[int]:
    """Global indices of the MoE layers (Megatron-Core's `moe_layer_freq`: an int N = every N-th
    layer, or a 0/1 list per layer; DeepSeek-V3's leading dense layers are 0s)."""
    if isinstance(moe_layer_freq, int):
        return [i for i in range(num_layers) if i % moe_layer_freq == 0]
    return [i for i, f in enumerate(moe_layer_freq) if f]


def all_layer_rows(rows: torch.Tensor, moe_layers: list[int], num_layers: int) -> torch.Tensor:
    """An engine's routing record [T, layers, k] spread over all decoder layers.

    Engines report one column per MoE layer (the embedded engine and SGLang skip dense
    layers); the learner keys replay rows by decoder layer. A record with one column per MoE
    layer becomes [T, num_layers, k] with -1 (not routed) for dense layers; any other width
    is returned as is (the caller checks it).
    """
    if rows.dim() != 3 or rows.shape[1] == num_layers or rows.shape[1] != len(moe_layers):
        return rows
    out = rows.new_full((rows.shape[0], num_layers, rows.shape[2]), -1)
    out[:, moe_layers] = rows
    return out
