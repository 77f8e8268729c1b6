"""MoE routing replay (R2 / R3) and routing metrics of the Megatron learner.

Routing replay makes the learner's MoE routers pick recorded experts instead of their own top-k:
- r2 replays the routing the learner itself chose at the step's start weights (recorded by the
  pi_old forward, or by a recording forward when the engine's log-probs are reused), in every
  training forward and recompute-in-backward of the step;
- r3 replays the rollout engine's routing (`Sample.routing`), in every policy forward.
The GSPO paper (arXiv 2507.18071) argues sequence-level ratios make MoE RL stable without it;
token-level GRPO on MoE needs it. Metrics of every MoE step (`pop_metrics`): routing agreement
between the learner's live top-k and the engine's (per layer), the expert-change rate across one
optimizer step, the share of router calls that replayed, tokens without a routing record.
Under r3 a layer's live top-k is computed on the hidden states that the replayed routing of the
layers before it produced (per-layer router disagreement, not a second, unreplayed forward).

Mechanism: Megatron-Core 0.16.1's RouterReplay (`moe_enable_routing_replay` gives each TopKRouter
a `router_replay`; actions RECORD / REPLAY_FORWARD / REPLAY_BACKWARD; the replayed experts'
probabilities are gathered from the full score tensor, so the router keeps its gradient). Where
it does not fit, the smallest alternative is used:
- `RouterReplay.set_replay_data` hands data out by position in a process-global instance list
  that also holds the routers of every other model built in the process (a KL reference, a
  rebuilt model); positions shift and routers silently route live. Here each router is reached
  through its own MoE layer in this rank's model chunks (global layer number known), and every
  replayed forward counts the routers that replayed: fewer than the chunk's MoE layers is a
  one-line `RoutingReplayError`.
- RECORD keeps only the last micro-batch. Routing is taken after each micro-batch's forward
  (inside the pipeline schedule's forward_step, per model chunk), gathered over TP (sequence
  parallel) and CP, and stored per sample, so records survive re-packing and DP re-planning.
- Nothing in Megatron switches to REPLAY_BACKWARD for activation recompute; the wrapper does when
  the router runs inside autograd's backward (FIFO per router, the schedules' backward order).
- Tokens without a record (the last sampled token, which the engine never fed to the model;
  packing padding; a sample the engine returned no routing for) are routed live and counted; the
  last token's routing changes no loss term (causal attention, per-token experts).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from megatron_gspo.convert.param_map import num_routed_experts
from megatron_gspo.data.batch import MicroBatch, cp_local_index
from megatron_gspo.megatron.compat import sorted_topk_indices
from megatron_gspo.megatron.moe.routing_exchange import (
    all_layer_rows,
    exchange_rows,
    moe_layer_indices,
)

MODES = ("none", "r2", "r3")


class RoutingReplayError(RuntimeError):
    """Routing replay that cannot run as configured (a router not replayed, no record)."""


def with_replay_enabled(hf_config: dict, model_kwargs: dict | None) -> dict:
    """`build_model_config` extras with Megatron's routing replay on for MoE models."""
    out = dict(model_kwargs or {})
    if num_routed_experts(hf_config):
        out.setdefault("moe_enable_routing_replay", True)
    return out


def attach(learner, mode: str) -> RoutingReplay | None:
    """The learner's `RoutingReplay` (None for a model without MoE layers; then `mode` must be
    "none")."""
    from megatron.core import parallel_state as ps

    cfg = learner.config
    if not cfg.num_moe_experts:
        if mode != "none":
            raise ValueError(f"moe.routing_replay: {mode!r} needs an MoE model "
                             f"({learner.hf_config.get('architectures')} has no routed experts)")
        return None
    return RoutingReplay(
        learner.chunks, learner.model, num_layers=cfg.num_layers, topk=cfg.moe_router_topk,
        num_experts=cfg.num_moe_experts, mode=mode,
        tp_group=ps.get_tensor_model_parallel_group(), cp_group=ps.get_context_parallel_group(),
        dp_group=ps.get_data_parallel_group(with_context_parallel=False),
        sequence_parallel=cfg.sequence_parallel,
        moe_layers=moe_layer_indices(cfg.moe_layer_freq, cfg.num_layers))


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class RoutingReplay:
    """The routers of this rank's model chunks, their replay and the per-sample records.

    Args:
        chunks: unwrapped GPTModel chunks of this rank.
        wrapped: the same chunks as the pipeline schedule sees them (DDP / Float16Module).
        num_layers: decoder layers of the whole model; topk / num_experts: router settings.
        mode: "none" | "r2" | "r3".
        tp_group, cp_group, dp_group: process groups; sequence_parallel: routers see S/tp tokens.
        moe_layers: global indices of the MoE layers (None: every layer); engine records with
            one column per MoE layer are spread over the decoder layers.
    """

    def __init__(self, chunks, wrapped, *, num_layers: int, topk: int, num_experts: int,
                 mode: str = "none", tp_group=None, cp_group=None, dp_group=None,
                 sequence_parallel: bool = False, moe_layers: list[int] | None = None):
        if mode not in MODES:
            raise ValueError(f"moe.routing_replay: {mode!r} not in {MODES}")
        self.mode, self.num_layers, self.topk, self.num_experts = mode, num_layers, topk, \
            num_experts
        self.tp_group, self.cp_group, self.dp_group = tp_group, cp_group, dp_group
        self.sp = sequence_parallel
        self.moe_layers = list(range(num_layers)) if moe_layers is None else list(moe_layers)
        self.chunk_of = {id(w): i for i, w in enumerate(wrapped)}
        self.routers = [self._chunk_routers(c, i) for i, c in enumerate(chunks)]  # per chunk
        self.records: dict[int, tuple] = {}  # id(sample) -> (weakref, version, [T, L, k])
        # per layer: engine-agreement sum, its count; then replayed routers, routers, tokens
        # without a record
        self._acc = torch.zeros(2 * num_layers + 3, dtype=torch.float64)
        self._chg = torch.zeros(2 * num_layers, dtype=torch.float64)  # per layer: changed, seen
        self._run = None

    # ------------------------------------------------------------------ routers
    def _chunk_routers(self, chunk, ci: int) -> list[tuple[int, object]]:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        out = []
        for layer in chunk.decoder.layers:
            if not isinstance(getattr(layer, "mlp", None), MoELayer):
                continue
            rr = layer.mlp.router.router_replay
            if rr is None:
                raise RoutingReplayError(
                    f"MoE layer {layer.layer_number} has no router_replay (build the model "
                    "config with moe_enable_routing_replay=True)")
            li = layer.layer_number - 1
            self._wrap(rr, li)
            out.append((li, rr))
        if len({id(rr) for _, rr in out}) != len(out):
            raise RoutingReplayError(f"model chunk {ci}: MoE layers share a router_replay")
        return out

    def _wrap(self, rr, li: int) -> None:
        """Per-instance get_replay_topk: live top-k always (metrics), replay targets merged
        with live routing where no record exists, REPLAY_BACKWARD inside backward."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

        orig = type(rr).get_replay_topk.__get__(rr)

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None,
                            default_compute_topk=None):
            run = self._run
            if run is None or rr.router_replay_action is None:
                return orig(scores, topk, num_groups, group_topk, default_compute_topk)
            if _in_backward():
                if rr.router_replay_action in (A.REPLAY_FORWARD, A.REPLAY_BACKWARD):
                    rr.router_replay_action = A.REPLAY_BACKWARD
                    try:
                        return orig(scores, topk, num_groups, group_topk, default_compute_topk)
                    finally:
                        rr.router_replay_action = A.REPLAY_FORWARD
                return orig(scores, topk, num_groups, group_topk, default_compute_topk)
            live = sorted_topk_indices(default_compute_topk, scores, topk, num_groups,
                                       group_topk)  # [N, k], a training forward's order
            run["live"][li] = live
            if rr.router_replay_action == A.REPLAY_FORWARD:
                idx, valid = run["targets"][li]  # [N, k], [N]
                if idx.shape != live.shape:
                    raise RoutingReplayError(
                        f"layer {li + 1}: replay rows {tuple(idx.shape)} do not match the "
                        f"router's tokens {tuple(live.shape)}")
                merged = torch.where(valid.to(live.device)[:, None], idx.to(live.device), live)
                rr.set_target_indices(merged)
                run["replayed"].add(li)
            return orig(scores, topk, num_groups, group_topk, default_compute_topk)

        rr.get_replay_topk = get_replay_topk

    # ------------------------------------------------------------------ one schedule run
    def begin(self, samples: list, mbs: list[MicroBatch], data: list[dict], *, version: int,
              replay: bool, training: bool, tp_rank: int, tp_size: int, cp_rank: int,
              cp_size: int) -> None:
        """Prepare one pipeline-schedule run over `mbs` (packed from `samples`; `data` their
        device batches): replay rows per micro-batch when `replay`; `training` forwards count
        towards `moe/routers_replayed_share`; `version`: optimizer steps taken so far."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

        if replay and self.mode == "r2":
            lost = [s.index for s in samples if self._source(s) is None]
            if lost:
                raise RoutingReplayError(
                    f"routing replay r2: samples {lost[:5]} have no routing recorded at the "
                    "step's start weights (run the pi_old or a recording forward first)")
        self._run = {"live": {}, "replayed": set(), "targets": {}, "captured": {},
                     "replay": replay, "training": training, "version": version, "mbs": mbs,
                     "samples": samples,
                     "tp": (tp_rank, tp_size), "cp": (cp_rank, cp_size), "data": {}}
        for i, d in enumerate(data):
            d["routing_mb"] = i
            if replay:
                self._run["data"][i] = self._targets(samples, mbs[i], tp_rank, tp_size, cp_rank,
                                                     cp_size)
        action = A.REPLAY_FORWARD if replay else A.RECORD
        for routers in self.routers:
            for _, rr in routers:
                rr.clear_indices()
                rr.set_router_replay_action(action)

    def _local_positions(self, mb: MicroBatch, tp_rank, tp_size, cp_rank, cp_size):
        pos = cp_local_index(mb.cu_seqlens, cp_size, cp_rank)  # [S/cp]
        if self.sp and tp_size > 1:
            n = pos.numel() // tp_size
            pos = pos[tp_rank * n:(tp_rank + 1) * n]
        return pos

    def _source(self, s):
        """[n, L, k] replay record of a sample (engine's for r3, learner's for r2), or None."""
        if self.mode == "r3":
            r = getattr(s, "routing", None)
            if r is not None:
                r = all_layer_rows(torch.as_tensor(r).long(), self.moe_layers, self.num_layers)
                if r.dim() == 3 and tuple(r.shape[1:]) == (self.num_layers, self.topk) and (
                        r.numel() == 0 or (int(r.min()) >= 0 and int(r.max()) < self.num_experts)):
                    return r
            return None
        rec = self.records.get(id(s))
        return None if rec is None or rec[0]() is not s else rec[2]

    def _targets(self, samples, mb: MicroBatch, tp_rank, tp_size, cp_rank, cp_size) -> dict:
        """{layer: (expert ids [S_local, k], has-record [S_local])} of one micro-batch for this
        rank's routers (padding and tokens without a record: has-record False)."""
        L, k = self.num_layers, self.topk
        lens = mb.seq_valid.sum(1).tolist()
        at, rows = [], []
        for i, si in enumerate(mb.sample_indices):
            src = self._source(samples[si])
            if src is not None:
                n = min(int(lens[i]), src.shape[0])
                at.append(mb.seq_index[i, :n])
                rows.append(src[:n])
        idx = torch.zeros(L, mb.seq_len, k, dtype=torch.long)  # [L, S, k]
        valid = torch.zeros(L, mb.seq_len, dtype=torch.bool)  # [L, S]
        if at:
            pos_all, src_all = torch.cat(at), torch.cat(rows).long()  # [N], [N, L, k]
            idx[:, pos_all] = src_all.permute(1, 0, 2).clamp(min=0)
            valid[:, pos_all] = (src_all >= 0).all(-1).t()
        pos = self._local_positions(mb, tp_rank, tp_size, cp_rank, cp_size)
        return {li: (idx[li, pos], valid[li, pos])
                for routers in self.routers for li, _ in routers}

    def wrap(self, forward_step):
        """forward_step_func that sets each micro-batch's replay rows for the chunk's routers and
        takes the routers' live top-k after the chunk's forward."""

        def routed_step(data_iterator, model):
            ci = self.chunk_of[id(model)]
            seen = {}

            class _It:
                def __next__(it):
                    d = next(data_iterator)
                    seen["d"] = d
                    if self._run["replay"]:
                        self._run["targets"] = self._run["data"][d["routing_mb"]]
                    return d

                def __iter__(it):
                    return it

            self._run["live"] = {}
            self._run["replayed"] = set()
            out = forward_step(_It(), model)
            mbi = seen["d"]["routing_mb"]
            layers = [li for li, _ in self.routers[ci]]
            done = self._run["replayed"] if self._run["replay"] else set(self._run["live"])
            if len(done & set(layers)) != len(layers):
                lost = sorted(li + 1 for li in set(layers) - done)
                raise RoutingReplayError(
                    f"routing {'replay' if self._run['replay'] else 'record'}: "
                    f"{len(done & set(layers))} of {len(layers)} MoE routers of model chunk {ci} "
                    f"took part; layers {lost} used a router instance this learner does not "
                    "drive (a router registered twice?)")
            for li in layers:
                self._run["captured"][(mbi, li)] = self._run["live"][li]
            if self._run["training"]:
                self._acc[-3] += len(self._run["replayed"])
                self._acc[-2] += len(layers)
            return out

        return routed_step

    def end(self, keep: bool = True) -> None:
        """After the schedule: gather the live routing to full rows, store per-sample records,
        update the metrics (`keep` False: only reset, after a failed run)."""
        run, self._run = self._run, None
        for routers in self.routers:
            for _, rr in routers:
                rr.clear_indices()
                rr.set_router_replay_action(None)
        if run is None or not keep:
            return
        samples, mbs, version = run["samples"], run["mbs"], run["version"]
        (tp_rank, tp_size), (cp_rank, cp_size) = run["tp"], run["cp"]
        L, k = self.num_layers, self.topk
        lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        rows: dict[int, torch.Tensor] = {}  # sample -> [T, L, k] (-1: not routed here)
        by_mb: dict[int, dict[int, torch.Tensor]] = {}
        for (mbi, li), live in run["captured"].items():
            by_mb.setdefault(mbi, {})[li] = live
        for mbi, layers in sorted(by_mb.items()):
            mb = mbs[mbi]
            lis = sorted(layers)
            stacked = torch.stack([layers[li] for li in lis], 1)  # [S_local, l, k], on device
            full = self._full_row(stacked, mb, tp_rank, tp_size, cp_rank, cp_size).cpu()
            lis_t = torch.tensor(lis)[None, :]
            for i, si in enumerate(mb.sample_indices):
                ti = mb.seq_valid[i].nonzero().squeeze(1)  # [n] token positions
                row = rows.get(si)
                if row is None:
                    row = rows[si] = torch.full((lens[si], L, k), -1, dtype=torch.int32)
                row[ti[:, None], lis_t] = full[mb.seq_index[i, ti]].to(torch.int32)
        if tp_rank == 0 and cp_rank == 0:
            self._metrics(samples, lens, rows, version)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            rows = exchange_rows(rows, lens, self._layers_here(), self.num_layers, self.topk,
                                 self.num_experts, self.dp_group)
        self._prune()
        for si, s in enumerate(samples):
            rec = self.records.get(id(s))
            if rec is None or rec[0]() is not s:
                got = rows.get(si)
                if got is None:  # routed by no rank
                    got = torch.full((lens[si], L, k), -1, dtype=torch.int32)
                self.records[id(s)] = (weakref.ref(s), version, got)

    def _layers_here(self) -> list[int]:
        return sorted(li for routers in self.routers for li, _ in routers)

    def _full_row(self, live, mb, tp_rank, tp_size, cp_rank, cp_size) -> torch.Tensor:
        """[S, ...] full packed row from this rank's [S_local, ...] share (SP and CP gathers,
        on `live`'s device: the routers' tensors, where the TP / CP groups' backend needs them)."""
        if self.sp and tp_size > 1:
            parts = [torch.empty_like(live) for _ in range(tp_size)]
            dist.all_gather(parts, live.contiguous(), group=self.tp_group)
            live = torch.cat(parts)  # [S/cp, ...]
        if cp_size > 1:
            parts = [torch.empty_like(live) for _ in range(cp_size)]
            dist.all_gather(parts, live.contiguous(), group=self.cp_group)
            full = torch.empty(mb.seq_len, *live.shape[1:], dtype=live.dtype, device=live.device)
            for r, part in enumerate(parts):
                full[cp_local_index(mb.cu_seqlens, cp_size, r).to(live.device)] = part
            return full
        return live

    def _metrics(self, samples, lens, rows: dict[int, torch.Tensor], version: int) -> None:
        """Agreement with the engine (each sample's first capture, [T-1] engine rows) and the
        expert change against a record taken one optimizer step earlier (`rows`: this rank's
        samples, [T, L, k] each)."""
        L = self.num_layers
        a_eng, b_eng, a_prev, b_prev = [], [], [], []
        for si, got in rows.items():
            s = samples[si]
            rec = self.records.get(id(s))
            if rec is None or rec[0]() is not s:
                r = getattr(s, "routing", None)
                if r is not None:
                    r = all_layer_rows(torch.as_tensor(r).long(), self.moe_layers, L)[:lens[si]]
                    if tuple(r.shape[1:]) == (L, self.topk):
                        eng = torch.full_like(got, -1)
                        eng[:r.shape[0]] = r
                        a_eng.append(got)
                        b_eng.append(eng)
            elif version == rec[1] + 1:
                a_prev.append(got)
                b_prev.append(rec[2])
        if a_eng:
            a, b = torch.cat(a_eng), torch.cat(b_eng)  # [N, L, k]
            has = (a >= 0).all(-1) & (b >= 0).all(-1)  # [N, L]
            inter = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1).double()  # [N, L]
            self._acc[:L] += torch.where(has, inter / self.topk, 0.0).sum(0)
            self._acc[L:2 * L] += has.sum(0).double()
        if a_prev:
            a, b = torch.cat(a_prev), torch.cat(b_prev)
            has = (a >= 0).all(-1) & (b >= 0).all(-1)  # [N, L]
            same = (a.sort(-1).values == b.sort(-1).values).all(-1)
            self._chg[:L] += (has & ~same).sum(0).double()
            self._chg[L:] += has.sum(0).double()

    def _prune(self) -> None:
        for key in [k for k, (ref, _, _) in self.records.items() if ref() is None]:
            del self.records[key]

    # ------------------------------------------------------------------ step level
    def has_record(self, samples: list, version: int) -> bool:
        """Every sample has a learner record taken at weights `version`."""
        return all((r := self.records.get(id(s))) is not None and r[0]() is s and r[1] == version
                   for s in samples)

    def count_no_record(self, samples: list) -> None:
        """Add the tokens of `samples` that have no replay record (r2: the learner's, on this
        rank's layers; r3 and none: the engine's) to this step's
        `moe/tokens_without_routing_record` (counted on global rank 0)."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        here = [li for routers in self.routers for li, _ in routers]
        missing = 0
        for s in samples:
            n = len(s.prompt_ids) + len(s.response_ids)
            if self.mode == "r2":
                src = self._source(s)
                missing += n if src is None else int((~(src[:, here] >= 0).all(-1).all(-1)).sum())
            else:
                r = getattr(s, "routing", None)
                missing += n if r is None else n - int(torch.as_tensor(r).shape[0])
        self._acc[-1] += missing

    def pop_metrics(self, device) -> dict[str, float]:
        """This step's `moe/*` metrics, reduced over all ranks (collective); resets them."""
        L = self.num_layers
        both = torch.cat([self._acc, self._chg]).to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both)
        acc, chg = both.cpu().split([self._acc.numel(), self._chg.numel()])
        self._acc.zero_()
        self._chg.zero_()
        m: dict[str, float] = {}
        cnt = acc[L:2 * L]
        if cnt.sum() > 0:
            per = (acc[:L] / cnt.clamp(min=1)).tolist()
            for i, v in enumerate(per):
                if cnt[i] > 0:
                    m[f"moe/routing_agreement/layer_{i}"] = v
            have = [v for i, v in enumerate(per) if cnt[i] > 0]
            m["moe/routing_agreement/mean"] = float(sum(have) / len(have))
            m["moe/routing_agreement/min"] = float(min(have))
        if chg[L:].sum() > 0:  # overall: every layer's changes over every layer's records
            m["moe/expert_change_rate"] = float(chg[:L].sum() / chg[L:].sum())
            for i in range(L):
                if chg[L + i] > 0:
                    m[f"moe/expert_change_rate/layer_{i}"] = float(chg[i] / chg[L + i])
        if acc[-2] > 0:
            m["moe/routers_replayed_share"] = float(acc[-3] / acc[-2])
        m["moe/tokens_without_routing_record"] = float(acc[-1])
        return m
