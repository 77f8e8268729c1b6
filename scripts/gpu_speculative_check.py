"""GPU check of speculative rollouts (issue 58 item 5, docs/speculative.md) on CUDA; without CUDA
the same on the CPU with tiny sizes (the dry run).

1. Exactness on the device. (a) `algo.speculative_sampling.verify_chain`: a toy target and draft
   over 4 tokens (next-token tables of the last two tokens, the draft different); --rows rows
   generate 3 tokens each in chains of K = 2; the 64 sequences' frequencies against their exact
   probabilities, chi-square below dof + 6 sqrt(2 dof) (tests/algo/test_speculative_sampling.py's
   method). (b) The embedded engine drafting (`rollout.embedded_speculative`: the KV cache with
   masked holes, under CUDA's SDPA kernels, which the CPU does not run) with a tiny random Qwen3
   and an MTP layer (6 tokens, K = 2), fp32 and bf16: sampled rows' log-probs = a teacher-forced
   target forward within TOL; greedy drafting = plain greedy decoding (tokens; log-probs within
   TOL; the tokens judged in fp32 only: a bf16 near-tie may flip between forwards of other shapes).
2. Costs on the device: a random model of Qwen3-0.6B's shape (28 layers, hidden 1024, vocab
   151,936; --layers / --hidden / --vocab shrink it), bf16, one MTP layer; wall ms per call
   (torch.cuda.synchronize; best of 3 blocks of --reps) at batch 1 and 16 after --prefix tokens:
   the plain 1-token step T(1), the (K+1)-token verification T(K+1), a draft call D(n) (the MTP
   layer over n slots, the shared head at one) and `verify_chain` VC(K). As docs/speculative.md
   accounts it, a verification costs C(K) = T(K+1) + D(K+1) + (K-1) D(1) + VC(K) and yields
   sum_{j<=K} a^j tokens at acceptance a: the break-even acceptance for K = 1, 2, 3 and the
   predicted speed-up T(1) sum_j a^j / C(K) at a = 0.5, 0.65, 0.77, 0.9. Random weights give no
   real acceptance: the speed-up is predicted from measured costs, not measured; the
   measured-acceptance figure needs a trained head (bench/speculative_rollouts.py on a GPU).

    python scripts/gpu_speculative_check.py [--layers 28] [--rows 20000] [--json OUT.json]

Prints each part, the cost table and last `ratio=` (the predicted speed-up at acceptance 0.77
with the best K, batch 1); writes --json (`summary_line` makes scripts/gpu_checks.sh's row);
exit 1 when an exactness check fails. Module level imports the standard library only.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import itertools
import json
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "qwen3", "vocab_size": 6, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 64, "tie_word_embeddings": False}
# engine vs teacher-forced log-probs. fp32: kernels of other shapes (CPU: 7e-7); bf16: rounding
# in either forward (CPU: 0.012). Holes left unmasked move them by ~1 (tests/gpu).
TOL = {"float32": 1e-4, "bfloat16": 6e-2}
ACCEPTANCES, KS = (0.5, 0.65, 0.77, 0.9), (1, 2, 3)


def check_verify_chain(device: str, rows: int, V: int = 4, N: int = 3, K: int = 2) -> dict:
    """Part 1a: sequences of the toy target drafted and verified on `device`."""
    import torch

    from megatron_gspo.algo import speculative_sampling as ss

    g = torch.Generator().manual_seed(5)
    tp, tq = ((torch.randn(V + 1, V + 1, V, generator=g) * 1.5).softmax(-1) for _ in range(2))
    tp_d, tq_d = tp.to(device), tq.to(device)  # [prev2, prev1, V]; index V: the start token
    gen = torch.Generator(device=device).manual_seed(1234)
    seq = torch.full((rows, N + K + 1), V, dtype=torch.long, device=device)
    lens = torch.zeros(rows, dtype=torch.long, device=device)
    r = torch.arange(rows, device=device)

    def draw(probs):
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

    def dist(table, extra):  # [B, V] after seq[:lens] then extra [B, j]
        j = extra.shape[1]

        def tok(back):
            if back <= j:
                return extra[:, j - back]
            i = lens - (back - j)
            return torch.where(i >= 0, seq[r, i.clamp(min=0)], torch.full_like(i, V))

        return table[tok(2), tok(1)]

    accepted = drafted = 0
    while bool((lens < N).any()):
        drafts, qs = [], []
        for _ in range(K):
            qs.append(dist(tq_d, torch.stack(drafts, 1) if drafts else seq[:, :0]))
            drafts.append(draw(qs[-1]))
        draft = torch.stack(drafts, 1)  # [B, K]
        p = torch.stack([dist(tp_d, draft[:, :j]) for j in range(K + 1)], 1)  # [B, K+1, V]
        u = torch.rand(rows, K, generator=gen, device=device)
        acc, toks = ss.verify_chain(p, torch.stack(qs, 1), draft, u, draw)
        accepted, drafted = accepted + int(acc[lens < N].sum()), drafted + K * int((lens < N).sum())
        for j in range(K + 1):  # the accepted + 1 emitted tokens
            take = (j <= acc) & (lens < N + K + 1)
            seq[r[take], lens[take]] = toks[take, j]
            lens = lens + take.long()
    codes = (seq[:, :N].cpu() * V ** torch.arange(N - 1, -1, -1)).sum(-1)
    counts = torch.bincount(codes, minlength=V ** N).double()
    exact = torch.tensor([math.prod(float(tp[h[i], h[i + 1], h[i + 2]]) for i in range(N))
                          for s in itertools.product(range(V), repeat=N) for h in [(V, V, *s)]],
                         dtype=torch.float64)
    chi2 = float(((counts - exact * rows) ** 2 / (exact * rows)).sum())
    dof = V ** N - 1
    bound = dof + 6 * (2 * dof) ** 0.5
    return {"device": device, "rows": rows, "K": K, "chi2": chi2, "dof": dof, "bound": bound,
            "acceptance": accepted / max(drafted, 1), "ok": chi2 < bound}


def check_engine(device: str, dtype: str, rows: int = 256, new: int = 12) -> dict:
    """Part 1b: the engine drafting (K = 2) against a teacher-forced forward and against plain
    greedy decoding."""
    import torch

    from megatron_gspo.rollout.embedded import EmbeddedEngine, build_hf_model
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams

    torch.manual_seed(11)
    model = build_hf_model(dict(TINY))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked next-token distributions
    plain = EmbeddedEngine(copy.deepcopy(model), dtype=dtype, device=device, eos_token_ids=[])
    eng = EmbeddedEngine(model, dtype=dtype, device=device, draft_steps=2, eos_token_ids=[])
    with torch.no_grad():  # a random head away from its init: acceptance ~ 0.4
        w = eng.draft.eh_proj.weight
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    eng.load_buckets([list(eng.draft.named_tensors().items())], 1)  # the head is "synced"
    prompt, temp = [1, 3, 4], 0.8
    out = eng.generate([GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(
        temperature=temp, top_k=4, max_new_tokens=new, n=rows))])
    m = eng.speculative_metrics()
    ids = torch.tensor([prompt + s.response_ids for s in out], device=device)  # [rows, P+new]
    with torch.no_grad():
        logp = torch.log_softmax(eng.model(input_ids=ids).logits.float() / temp, -1)
    ref = logp[:, len(prompt) - 1:-1].gather(-1, ids[:, len(prompt):, None])[..., 0]
    got = torch.tensor([s.rollout_logprobs for s in out], device=device)
    reqs = [GenerateRequest(prompt_ids=p, sampling=SamplingParams(temperature=0.0,
                                                                  max_new_tokens=new))
            for p in ([1, 2], [3, 4, 5, 1], [5], [2, 2, 2, 3, 1])]
    pairs = [(x, y) for x, y in zip(eng.generate(reqs), plain.generate(reqs), strict=True)
             if x.response_ids == y.response_ids]
    greedy = max((float((torch.tensor(x.rollout_logprobs) - torch.tensor(y.rollout_logprobs))
                        .abs().max()) for x, y in pairs), default=None)
    res = {"dtype": dtype, "rows": rows, "new": new, "tol": TOL[dtype],
           "acceptance": m.get("speculative/acceptance") or 0.0, "on": m.get("speculative/on"),
           "sampled_max_abs": float((got - ref).abs().max()), "greedy_rows": len(reqs),
           "greedy_same": len(pairs), "greedy_max_abs": greedy, "failures": []}
    fail = res["failures"].append
    if res["on"] != 1.0 or not 0.05 < res["acceptance"] < 0.98:
        fail(f"{dtype}: no drafting with rejections (on {res['on']}, acceptance "
             f"{res['acceptance']:.3f})")
    if not res["sampled_max_abs"] <= TOL[dtype]:
        fail(f"{dtype}: sampled log-probs {res['sampled_max_abs']:.3g} from the teacher-forced "
             f"forward's (tolerance {TOL[dtype]:g})")
    if dtype == "float32" and len(pairs) < len(reqs):
        fail(f"{dtype}: greedy drafting differs from plain greedy decoding in "
             f"{len(reqs) - len(pairs)} of {len(reqs)} rows")
    if greedy is not None and not greedy <= TOL[dtype]:
        fail(f"{dtype}: greedy log-probs {greedy:.3g} from plain decoding's (tolerance "
             f"{TOL[dtype]:g})")
    return res


def measure_costs(device: str, layers: int, hidden: int, vocab: int, prefix: int,
                  batches: list[int], reps: int) -> dict:
    """Part 2: ms per call of the target, the draft and verify_chain, and `analyse`."""
    import torch
    import transformers

    from megatron_gspo.rollout.mtp_draft import MTPDraft

    heads = max(2, hidden // 64)  # Qwen3-0.6B: 16 query and 8 KV heads of 128
    cfg = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the device
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    d = MTPDraft(m)
    kw = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
    res = {"device": device, "layers": layers, "hidden": hidden, "vocab": vocab,
           "prefix": prefix, "reps": reps, "params": sum(p.numel() for p in m.parameters()),
           "draft_params": sum(p.numel() for p in d.parameters()), "batches": {}}

    with torch.no_grad():
        for b in batches:
            res["batches"][str(b)] = batch_costs(m, d, kw, b, prefix, reps)
    res["analysis"] = {b: analyse(c) for b, c in res["batches"].items()}
    return res


def batch_costs(m, d, kw: str, b: int, P: int, reps: int) -> dict:
    """ms per call at batch `b` after P cached tokens: target(n), draft(n), verify_chain(k)."""
    import torch
    from transformers import DynamicCache

    from megatron_gspo.algo.speculative_sampling import verify_chain

    dev, V, H, n_max = m.device, m.config.vocab_size, m.config.hidden_size, max(KS) + 1
    ids = torch.randint(0, V, (b, P + n_max), device=dev)
    h = torch.randn(b, P + n_max, H, device=dev, dtype=torch.bfloat16)
    one = torch.ones(b, P + n_max, dtype=torch.long, device=dev)
    pos = torch.arange(P + n_max, device=dev)[None].expand(b, -1)
    cache, dcache = DynamicCache(), DynamicCache()
    m(input_ids=ids[:, :P], attention_mask=one[:, :P], use_cache=True, logits_to_keep=1,
      **{kw: cache})
    d(ids[:, :P], h[:, :P], pos[:, :P], one[:, :P], dcache)

    def target(n):
        m(input_ids=ids[:, P:P + n], attention_mask=one[:, :P + n], position_ids=pos[:, P:P + n],
          use_cache=True, **{kw: cache})
        cache.crop(-n)

    def draft(n):
        o = d(ids[:, P:P + n], h[:, P:P + n], pos[:, P:P + n], one[:, :P + n], dcache)
        d.logits(o[:, -1])
        dcache.crop(-n)

    def verify(k):
        p = torch.softmax(torch.randn(b, k + 1, V, device=dev), -1)
        q = torch.softmax(torch.randn(b, k, V, device=dev), -1)
        u = torch.rand(b, k, device=dev)
        return lambda: verify_chain(p, q, ids[:, :k], u, lambda x: torch.multinomial(x, 1)[:, 0])

    def timed(fn) -> float:
        best = float("inf")
        for i in range(4):  # a warm-up block, then the best of 3
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = best if i == 0 else min(best, (time.perf_counter() - t) / reps * 1e3)
        return best

    return {"target": {str(n): timed(lambda n=n: target(n)) for n in range(1, n_max + 1)},
            "draft": {str(n): timed(lambda n=n: draft(n)) for n in range(1, n_max + 1)},
            "verify_chain": {str(k): timed(verify(k)) for k in KS}}


def analyse(c: dict) -> dict:
    """Per K: a verification's cost, the break-even acceptance (None: above 1), the speed-ups."""
    t1, out = c["target"]["1"], {}
    for k in KS:
        cost = (c["target"][str(k + 1)] + c["draft"][str(k + 1)] + (k - 1) * c["draft"]["1"]
                + c["verify_chain"][str(k)])
        need, lo, hi = cost / t1, 0.0, 1.0
        for _ in range(60):  # sum_j a^j rises with a: bisection
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if sum(mid ** j for j in range(k + 1)) >= need else (mid, hi)
        out[str(k)] = {"verify_ms": cost, "break_even_tokens": need,
                       "break_even_acceptance": hi if need <= k + 1 else None,
                       "speedup": {str(a): sum(a ** j for j in range(k + 1)) * t1 / cost
                                   for a in ACCEPTANCES}}
    return out


def ratio(res: dict) -> float | None:
    a = (res.get("costs") or {}).get("analysis", {}).get("1")
    return max(v["speedup"]["0.77"] for v in a.values()) if a else None


def summary_line(res: dict) -> str:
    """The speculative stage's cell of scripts/gpu_checks.sh's summary (its --json report)."""
    parts = []
    v = res.get("verify_chain")
    if v:
        parts.append(f"verify_chain on {v['device']}: chi2 {v['chi2']:.1f} ({v['dof']} dof, "
                     f"bound {v['bound']:.0f}), {v['rows']} rows, K={v['K']}, acceptance "
                     f"{v['acceptance']:.2f}")
    for e in res.get("engine") or []:
        g = "n/a" if e["greedy_max_abs"] is None else f"{e['greedy_max_abs']:.2g}"
        parts.append(f"engine {e['dtype']}: sampled log-probs vs teacher-forced max abs diff "
                     f"{e['sampled_max_abs']:.2g} (tol {e['tol']:g}), greedy = plain in "
                     f"{e['greedy_same']}/{e['greedy_rows']} rows (log-probs {g}), acceptance "
                     f"{e['acceptance']:.2f}")
    c = res.get("costs")
    for b, a in (c or {}).get("analysis", {}).items():
        be = "/".join("none" if x["break_even_acceptance"] is None
                      else f"{x['break_even_acceptance']:.2f}" for x in a.values())
        k = max(a, key=lambda k: a[k]["speedup"]["0.77"])
        parts.append(f"batch {b} ({c['layers']} layers, hidden {c['hidden']}, vocab "
                     f"{c['vocab']}, bf16): plain step {c['batches'][b]['target']['1']:.3g} ms, "
                     f"verification K=2 {a['2']['verify_ms']:.3g} ms, draft call "
                     f"{c['batches'][b]['draft']['1']:.3g} ms; break-even acceptance K=1/2/3 "
                     f"{be}; predicted {a[k]['speedup']['0.77']:.2f}x at 0.77 (K={k})")
    if ratio(res) is not None:
        parts.append(f"ratio={ratio(res):.3f} (predicted from costs, random weights)")
    if res.get("failures"):
        parts.append(f"{len(res['failures'])} failure(s), first: {res['failures'][0]}")
    return "; ".join(parts) or "no report"


def print_table(c: dict) -> None:
    print(f"costs per call, ms ({c['device']}, bf16, {c['layers']} layers, hidden {c['hidden']}, "
          f"vocab {c['vocab']}: {c['params'] / 1e6:.1f} M params, draft layer "
          f"{c['draft_params'] / 1e6:.1f} M; prefix {c['prefix']})")
    for b, cb in c["batches"].items():
        print(f"batch {b}: " + ", ".join(f"{k}({n}) {ms:.3f}" for k in cb
                                         for n, ms in cb[k].items()))
    print(f"{'batch':>5} {'K':>2} {'verify ms':>9} {'plain ms':>8} {'b-e tok':>7} {'b-e acc':>7} "
          + " ".join(f"{'x@' + str(a):>6}" for a in ACCEPTANCES))
    for b, an in c["analysis"].items():
        for k, a in an.items():
            be = a["break_even_acceptance"]
            print(f"{b:>5} {k:>2} {a['verify_ms']:>9.3f} {c['batches'][b]['target']['1']:>8.3f} "
                  f"{a['break_even_tokens']:>7.2f} {'none' if be is None else f'{be:.2f}':>7} "
                  + " ".join(f"{a['speedup'][str(x)]:>6.2f}" for x in ACCEPTANCES))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28, help="Qwen3-0.6B has 28")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prefix", type=int, default=256, help="tokens cached before the timing")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--reps", type=int, default=8, help="calls per timed block")
    ap.add_argument("--rows", type=int, default=20000, help="rows of the verify_chain check")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "engine": [], "failures": []}
    batches = [int(b) for b in args.batches.split(",")]
    parts = [("verify_chain", lambda: check_verify_chain(device, args.rows))]
    parts += [("engine", lambda dt=dt: check_engine(device, dt)) for dt in TOL]
    parts += [("costs", lambda: measure_costs(device, args.layers, args.hidden, args.vocab,
                                              args.prefix, batches, args.reps))]
    for name, fn in parts:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - the other parts still run
            traceback.print_exc()
            res["failures"].append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        if name == "engine":
            res["engine"].append(out)
            res["failures"] += out["failures"]
        else:
            res[name] = out
        if name == "verify_chain" and not out["ok"]:
            res["failures"].append(f"verify_chain: chi2 {out['chi2']:.1f} is not below the "
                                   f"bound {out['bound']:.0f} ({out['dof']} dof)")
        if name == "costs":
            print_table(out)
        else:
            print(summary_line({name: [out] if name == "engine" else out}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(summary_line(res))
    for f in res["failures"]:
        print(f"FAIL: {f}")
    r = ratio(res)
    print(f"ratio={'nan' if r is None else f'{r:.3f}'}")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
