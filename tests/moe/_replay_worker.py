"""Worker processes for the MoE routing-replay tests (launched by `tests/megatron/_dist.launch`).

Cases:
  one  (1 rank)  r2 replay == live routing (loss, gradients; bitwise), also with activation
                 recompute (REPLAY_BACKWARD); router gradient under replay; after an optimizer
                 step the replayed experts are the recorded ones on every layer while live
                 routing moved; a router registered twice is caught; the last token's routing
                 changes nothing; r3 makes the learner use the given routing.
  par  (2 ranks) r2 replay == live routing (bitwise) under TP2+SP+EP2, PP2 and PP2+VPP2, and
                 the replayed experts equal the records on every rank's layers.
  engine (1 rank) r3 with the embedded engine in bfloat16 and the learner in float32: the
                 agreement metric is below 1 and equals a direct count; replay uses the
                 engine's routing.
Each rank writes `<case>.rank<r>.json` = {"failures": [...], "info": {...}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.megatron._workers import MOE, Checker, run_case, make_samples  # noqa: E402

MOE_PRE = dict(MOE, norm_topk_prob=False)  # Qwen3-MoE's default: softmax, then top-k
BASE = ROOT / "examples" / "moe" / "base"


def _learner(hf=MOE, layout=None, mode="none", *, lr=1e-3, recompute=False, mbs=2, seed=7):
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings

    return Learner(hf, layout=layout, optim=OptimSettings(lr=lr), seed=seed,
                   batching=BatchSettings(num_microbatches=mbs), routing_replay=mode,
                   recompute=recompute)


class RoutingTap:
    """Forward hooks on the TopKRouters of a learner: the expert sets Megatron dispatched
    (routing_map [N, E]) of every router call, by global layer."""

    def __init__(self, learner):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.calls: dict[int, list[torch.Tensor]] = {}
        self.hooks = []
        for chunk in learner.chunks:
            for layer in chunk.decoder.layers:
                if isinstance(layer.mlp, MoELayer):
                    li = layer.layer_number - 1
                    self.hooks.append(layer.mlp.router.register_forward_hook(
                        lambda m, a, out, li=li: self.calls.setdefault(li, []).append(
                            out[1].detach().clone())))

    def close(self):
        for h in self.hooks:
            h.remove()


def _sets(routing_map: torch.Tensor) -> list[tuple]:
    return [tuple(torch.nonzero(r).flatten().tolist()) for r in routing_map]


def check_tap_equals(chk: Checker, tag: str, learner, samples, tap: RoutingTap, source,
                     skip_last: bool) -> int:
    """The experts Megatron used (tap, first forward of each micro-batch) equal `source(s)`
    [T, L, k] on every layer of this rank, token by token (under SP/CP: this rank's share is
    compared through the full row, so the check covers the packing and the SP split)."""
    from megatron.core import parallel_state as ps

    mbs = learner._micro_batches(samples, None)
    tp, tpr = learner.layout.tensor, ps.get_tensor_model_parallel_rank()
    checked = 0
    for li, calls in tap.calls.items():
        for mbi, mb in enumerate(mbs):
            got = _sets(calls[mbi])
            pos = torch.arange(mb.seq_len)
            if learner.config.sequence_parallel:
                n = mb.seq_len // tp
                pos = pos[tpr * n:(tpr + 1) * n]
            where = {int(p): j for j, p in enumerate(pos)}
            for i, si in enumerate(mb.sample_indices):
                s = samples[si]
                t = len(s.prompt_ids) + len(s.response_ids)
                src = source(s)
                for tok in range(t - 1 if skip_last else t):
                    p = int(mb.seq_index[i, tok])
                    if p not in where:
                        continue
                    want = tuple(sorted(int(e) for e in src[tok, li]))
                    if got[where[p]] != want:
                        chk.failures.append(f"{tag}: layer {li} sample {si} token {tok}: "
                                            f"used {got[where[p]]}, recorded {want}")
                        return checked
                    checked += 1
    return checked


def _grads_equal(chk: Checker, tag: str, a: dict, b: dict) -> None:
    for k in sorted(a):
        if not torch.equal(a[k], b[k]):
            chk.failures.append(f"{tag}: gradient {k} differs (max {(a[k] - b[k]).abs().max()})")
            return


def _replay_equals_live(chk: Checker, tag: str, hf, layout, full, samples, recompute=False):
    """r2 replay at unchanged weights: loss and gradients bitwise equal to live routing. The
    routing is recorded over the whole batch and replayed on a mini-batch of it (packed and
    planned over DP ranks differently)."""
    part = samples[1:7]
    zeros = [[0.0] * len(s.response_ids) for s in part]
    live = _learner(hf, layout, "none", recompute=recompute)
    live.load_full_state_dict(full)
    m_live = live.forward_backward(part, zeros)
    g_live = live.full_grads()
    rep = _learner(hf, layout, "r2", recompute=recompute)
    rep.load_full_state_dict(full)
    rep.forward_logprobs(samples)  # the recording forward (pi_old)
    m_rep = rep.forward_backward(part, zeros)
    g_rep = rep.full_grads()
    if m_rep["loss"] != m_live["loss"]:
        chk.failures.append(f"{tag}: loss {m_rep['loss']!r} != live {m_live['loss']!r}")
    _grads_equal(chk, tag, g_rep, g_live)
    share = rep.routing.pop_metrics(rep.device)["moe/routers_replayed_share"]
    if share != 1.0:
        chk.failures.append(f"{tag}: routers replayed share {share}")
    live.routing.pop_metrics(live.device)
    return rep, m_rep


def case_one(outdir: Path, chk: Checker, info: dict):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_gspo.megatron.moe.router_replay import RoutingReplayError

    samples = make_samples()
    base = _learner(MOE_PRE)
    full = {k: v.clone() for k, v in base.full_state_dict().items()}
    # 1. replay == live, with and without recompute-in-backward
    rep, _ = _replay_equals_live(chk, "one", MOE_PRE, None, full, samples)
    _replay_equals_live(chk, "one.recompute", MOE_PRE, None, full, samples, recompute=True)
    g = rep.full_grads()
    router = [k for k in g if "router" in k]
    info["router_grad_norms"] = [float(g[k].norm()) for k in router]
    if not router or min(info["router_grad_norms"]) <= 0:
        chk.failures.append(f"router gradient under replay is zero: {info['router_grad_norms']}")
    # 2. after an optimizer step (large lr: built to move routing), r2 replays the records
    mover = _learner(MOE_PRE, mode="r2", lr=0.05)
    mover.load_full_state_dict(full)
    old = mover.forward_logprobs(samples)
    mover.train_step(samples, old)
    mover.routing.pop_metrics(mover.device)
    tap = RoutingTap(mover)
    mover.forward_backward(samples, old)
    tap.close()
    m = mover.routing.pop_metrics(mover.device)
    info["after_step"] = m
    info["moe_layers"] = len(mover.routing.moe_layers)
    rec = {id(s): mover.routing.records[id(s)][2] for s in samples}
    info["replayed_checked"] = check_tap_equals(chk, "r2 after a step", mover, samples, tap,
                                                lambda s: rec[id(s)], skip_last=False)
    if not m.get("moe/expert_change_rate", 0) > 0:
        chk.failures.append(f"live routing did not move after the step: {m}")
    # 3. a router registered twice (the layer holds a newer instance) is caught
    orphan = _learner(MOE_PRE, mode="r2")
    orphan.load_full_state_dict(full)
    orphan.forward_logprobs(samples)
    layer = orphan.chunks[0].decoder.layers[1]
    layer.mlp.router.router_replay = RouterReplay()
    info["global_router_instances"] = len(RouterReplay.global_router_replay_instances)
    try:
        orphan.forward_backward(samples, old)
        chk.failures.append("a router registered twice was not caught")
    except RoutingReplayError as e:
        info["orphan_error"] = str(e)
        if "\n" in str(e) or "layers [2]" not in str(e):
            chk.failures.append(f"orphan error is not one line naming layer 2: {e}")
    # 4. r3: the learner uses the given routing; the last token's routing changes nothing
    g0 = torch.Generator().manual_seed(5)
    for s in samples:
        t = len(s.prompt_ids) + len(s.response_ids)
        s.routing = torch.stack([torch.randperm(4, generator=g0)[:2] for _ in range(t * 4)]
                                ).reshape(t, 4, 2).to(torch.int32)
    r3 = _learner(MOE_PRE, mode="r3")
    r3.load_full_state_dict(full)
    tap = RoutingTap(r3)
    a = r3.forward_backward(samples, old)
    tap.close()
    ga = r3.full_grads()
    info["r3_checked"] = check_tap_equals(chk, "r3", r3, samples, tap, lambda s: s.routing,
                                          skip_last=True)
    for s in samples:  # another routing for the last token only
        s.routing[-1] = (s.routing[-1] + 1) % 4
    b = r3.forward_backward(samples, old)
    if a["loss"] != b["loss"]:
        chk.failures.append(f"last token's routing changed the loss: {a['loss']} {b['loss']}")
    _grads_equal(chk, "last token", r3.full_grads(), ga)
    for s in samples:  # the engine's rows (T - 1): the last token has no record
        s.routing = s.routing[:-1]
    c = r3.forward_backward(samples, old)
    if a["loss"] != c["loss"]:
        chk.failures.append(f"no record for the last token changed the loss: {c['loss']}")
    r3.routing.count_no_record(samples)
    info["r3_metrics"] = r3.routing.pop_metrics(r3.device)
    if info["r3_metrics"]["moe/tokens_without_routing_record"] != len(samples):
        chk.failures.append(f"tokens without record: {info['r3_metrics']}")


class CollectiveSizes:
    """Records (group, numel, device) of every all_reduce / all_gather made inside."""

    def __enter__(self):
        import torch.distributed as dist

        self.calls, self._orig = [], (dist.all_reduce, dist.all_gather)
        ar, ag = self._orig

        def all_reduce(t, *a, group=None, **k):
            self.calls.append((group, t.numel(), t.device.type))
            return ar(t, *a, group=group, **k)

        def all_gather(out, t, *a, group=None, **k):
            self.calls.append((group, t.numel(), t.device.type))
            return ag(out, t, *a, group=group, **k)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_reduce, dist.all_gather = self._orig
        return False


def check_dp_payload(chk: Checker, name: str, rep, samples, calls) -> None:
    """The routing records crossing the data-parallel group: only the rows each rank owns
    (less than one full [T, L, k] record of every sample), never the dense [B, T, L, k]."""
    import torch.distributed as dist

    rr = rep.routing
    if rr.dp_group is None or dist.get_world_size(rr.dp_group) < 2:
        return
    on_dp = [n for g, n, _ in calls if g is rr.dp_group]
    full = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples) * rr.num_layers * rr.topk
    if not on_dp:
        chk.failures.append(f"{name}: no routing exchange over the data-parallel group")
    elif max(on_dp) >= full:
        chk.failures.append(f"{name}: {max(on_dp)} elements crossed the data-parallel group in "
                            f"one collective, >= every sample's full record ({full})")


def case_par(outdir: Path, chk: Checker, info: dict):
    from megatron_gspo.megatron import parallel

    PL = parallel.ParallelLayout
    samples = make_samples()
    torch.manual_seed(0)
    base = None
    layouts = (("tp2-sp-ep2", PL(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True)),
               ("pp2", PL(pipeline=2)), ("pp2-vpp2", PL(pipeline=2, virtual_pipeline=2)),
               ("dp2", PL()))
    for name, layout in layouts:
        if base is None:
            first = _learner(MOE_PRE, layout, "none")
            base = {k: v.clone() for k, v in first.full_state_dict().items()}
        rep, m = _replay_equals_live(chk, name, MOE_PRE, layout, base, samples)
        tap = RoutingTap(rep)
        with CollectiveSizes() as sizes:
            rep.forward_backward(samples, [[0.0] * len(s.response_ids) for s in samples])
        tap.close()
        check_dp_payload(chk, name, rep, samples, sizes.calls)
        rec = {id(s): rep.routing.records[id(s)][2] for s in samples}
        info[name] = {"loss": m["loss"], "checked": check_tap_equals(
            chk, f"{name} replayed", rep, samples, tap, lambda s, rec=rec: rec[id(s)],
            skip_last=False)}


def _prompts(tok, n: int) -> list[list[int]]:
    import random

    rng = random.Random(3)
    out = []
    for _ in range(n):
        q = f"What is {rng.randint(10, 99)}+{rng.randint(10, 99)}?"
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def case_engine(outdir: Path, chk: Checker, info: dict):
    """r3 with the embedded engine (bfloat16) and the learner (float32) on the MoE demo model."""
    from transformers import AutoTokenizer

    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.convert.registry import get_adapter
    from megatron_gspo.megatron.io import dist_checkpoint as checkpoint_io
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
    from megatron_gspo.rollout.embedded import EmbeddedEngine, RoutingCapture, moe_routers

    hf = json.loads((BASE / "config.json").read_text())
    adapter = get_adapter(hf)

    def learner_for(mode):
        lrn = _learner(hf, None, mode)
        reader = HFCheckpointReader(str(BASE))
        with torch.no_grad():
            checkpoint_io.load_hf_weights(lrn.chunks, reader, adapter,
                                          adapter.dims(checkpoint_io.normalize_hf_config(hf)))
        reader.close()
        lrn._refresh_main_params()
        return lrn

    tok = AutoTokenizer.from_pretrained(str(BASE))
    engine = EmbeddedEngine(str(BASE), dtype="bfloat16", seed=11, return_routing=True)
    reqs = [GenerateRequest(prompt_ids=p, sampling=SamplingParams(n=4, max_new_tokens=8))
            for p in _prompts(tok, 8)]
    samples = engine.generate(reqs)
    for i, s in enumerate(samples):
        s.index, s.advantage = i, float(i % 3 - 1)
    # 1. live learner (routing_replay none): agreement metric vs a direct count of the experts
    #    Megatron's routers dispatched (hooks) against the engine's, token by token
    live = learner_for("none")
    tap = RoutingTap(live)
    live.forward_logprobs(samples)
    tap.close()
    m = live.routing.pop_metrics(live.device)
    info["metrics"] = m
    layers = hf["num_hidden_layers"]
    hit = torch.zeros(layers, dtype=torch.float64)
    cnt = torch.zeros(layers, dtype=torch.float64)
    mbs = live._micro_batches(samples, None)
    for li in range(layers):
        for mbi, mb in enumerate(mbs):
            used = _sets(tap.calls[li][mbi])
            for i, si in enumerate(mb.sample_indices):
                eng = samples[si].routing
                for t in range(eng.shape[0]):
                    a = set(used[int(mb.seq_index[i, t])])
                    b = {int(e) for e in eng[t, li]}
                    hit[li] += len(a & b) / len(b)
                    cnt[li] += 1
    direct = (hit / cnt).tolist()
    info["direct"] = direct
    for li in range(layers):
        got = m.get(f"moe/routing_agreement/layer_{li}")
        if got is None or abs(got - direct[li]) > 1e-12:
            chk.failures.append(f"layer {li}: agreement metric {got} != direct count {direct[li]}")
    if not m["moe/routing_agreement/mean"] < 1.0:
        chk.failures.append(f"bfloat16 engine vs float32 learner agree fully: {m}")
    if abs(m["moe/routing_agreement/min"] - min(direct)) > 1e-12:
        chk.failures.append("agreement min is not the smallest layer's")
    # the learner's live routing is the float32 HF model's (up to near-ties)
    fp32 = EmbeddedEngine(str(BASE), dtype="float32").model
    same = total = 0
    for s in samples:
        cap = RoutingCapture(moe_routers(fp32))
        with torch.no_grad():
            fp32(input_ids=torch.tensor([s.tokens]))
        cap.end_forward()
        cap.close()
        rec = live.routing.records[id(s)][2]
        same += int((rec.sort(-1).values == cap.forwards[0].long().sort(-1).values).all(-1).sum())
        total += rec.shape[0] * layers
    info["learner_equals_hf_fp32"] = same / total
    # 2. r3: every learner forward uses the engine's routing (the last token: live)
    r3 = learner_for("r3")
    tap = RoutingTap(r3)
    r3.forward_logprobs(samples)
    tap.close()
    info["r3_metrics"] = r3.routing.pop_metrics(r3.device)
    info["replayed_checked"] = check_tap_equals(chk, "engine r3", r3, samples, tap,
                                                lambda s: s.routing, skip_last=True)


def main():
    run_case({"one": case_one, "par": case_par, "engine": case_engine})


if __name__ == "__main__":
    main()
