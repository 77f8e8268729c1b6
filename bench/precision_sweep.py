"""Precision-tolerance sweep: where the rollout engine's log-probs can stand in for pi_old.

For each engine/learner dtype pair and response length L, on the first mini-batch of a step
(learner weights = pi_old = the engine's weights), this measures what the trainer's audit
measures: the per-token mismatch logp_learner - logp_engine, the sequence mismatch
d_i = mean_t(logp_learner - logp_engine), the share of sequences whose d_i falls outside
GSPO's clip range (3e-4 / 4e-4) and of tokens outside GRPO's (0.2 / 0.28), and what
`precision.old_logprobs: auto` (`ToleranceController`, the trainer's own) decides on that audit.

The real paths: the embedded rollout engine, in the engine dtype, samples the responses (and
their log-probs); the Megatron-Core learner, in the learner dtype, loaded from the same model
directory, recomputes them (`Learner.forward_logprobs`, the pass the trainer runs to recompute
or audit pi_old); the audit is `algo.precision.audit_sums`. No training.

Length control: responses are sampled with `ignore_eos` and `max_new_tokens = max(lengths)`, so
every response has exactly that many tokens; the response of length L is its first L tokens.
Decoding is causal and token by token, so the engine's first L tokens and log-probs are the ones
an L-token request with the same seed and batch would give; the learner recomputes each length
as its own batch of L-token responses (the forward the trainer would run), so a length's
numbers do not come from a longer forward. The lengths are nested (the same responses cut
shorter), so neighbouring points are correlated.

    python bench/precision_sweep.py [--model DIR] [--data FILE] [--prompts 16] [--group 8]
        [--longest-prompts]
        [--lengths 4,8,...,512] [--pairs fp32/fp32,bf16/fp32,bf16/bf16,fp16/fp32]
        [--out docs/results/precision-sweep]

Writes OUT.json (every point) and OUT.png (share against length with the 1/sqrt(L)
expectation), and prints the tables in markdown. The last line is `ratio=<share of pairs safe
at the longest length>`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_gspo.convert.param_map import num_routed_experts  # noqa: E402
from megatron_gspo.data.batch import pad_rows  # noqa: E402
from megatron_gspo.algo.precision import (  # noqa: E402
    ToleranceController,
    audit_sums,
    finalize_audit,
    mismatch_band,
)

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_LENGTHS = (4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_PAIRS = ("fp32/fp32", "bf16/fp32", "bf16/bf16", "fp16/fp32")


def measure(learner_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor, *,
            gspo_clip: tuple[float, float], grpo_clip: tuple[float, float],
            tolerance: float, mismatch_scale: float = 1.0, audit_fraction: float = 0.25,
            recheck_interval: int = 5) -> dict:
    """One sweep point: the trainer's audit numbers and `auto`'s decision at step 0.

    Args:
        learner_lp, engine_lp, mask: `[B, T]` log-probs of the learner and of the engine and
            the trainable-token mask.
        gspo_clip, grpo_clip: (eps_low, eps_high) of each loss.
        tolerance, mismatch_scale, audit_fraction, recheck_interval: `precision.*` settings.
    Returns:
        dict of floats: token_abs_diff_mean/max, token_diff_mean/std (per-token logp_learner -
        logp_engine), seq_mismatch_mean/std/abs_mean/abs_max (d_i), gspo_seq_out (share of
        sequences out of GSPO's range), grpo_token_out (share of tokens out of GRPO's),
        k3_kl, engine_logp_mean, and auto_gspo / auto_grpo: "rollout" or "recompute".
    """
    on = mask > 0
    diff = (learner_lp.double() - engine_lp.double())[on]
    d = ((learner_lp.double() - engine_lp.double()) * on).sum(-1) / on.sum(-1).clamp(min=1)
    d = d[on.any(-1)]
    out = {
        "token_diff_mean": float(diff.mean()) if diff.numel() else 0.0,
        "token_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0,
        "seq_mismatch_std": float(d.std()) if d.numel() > 1 else 0.0,
        "engine_logp_mean": float(engine_lp.double()[on].mean()) if diff.numel() else 0.0,
    }
    for loss, clip, level in (("gspo", gspo_clip, "sequence"), ("grpo", grpo_clip, "token")):
        audit = finalize_audit(audit_sums(learner_lp, engine_lp, mask, eps_low=clip[0],
                                          eps_high=clip[1], scale=mismatch_scale, level=level))
        ctl = ToleranceController("auto", audit_fraction=audit_fraction, tolerance=tolerance,
                                  recheck_interval=recheck_interval)
        if not ctl.needs_learner_logprobs(0):
            raise RuntimeError("auto did not audit step 0")
        out[f"auto_{loss}"] = ctl.decide(0, audit)
        out[f"{loss}_{'seq' if level == 'sequence' else 'token'}_out"] = \
            audit["out_of_range_fraction"]
        if loss == "gspo":
            out.update({k: audit[k] for k in ("token_abs_diff_mean", "token_abs_diff_max",
                                              "seq_mismatch_mean", "seq_abs_mismatch_mean",
                                              "seq_abs_mismatch_max", "k3_kl")})
    return out


def expected_share(mu: float, sigma: float, length: int, clip: tuple[float, float],
                   scale: float = 1.0) -> float:
    """Share of sequences out of the clip band if d_i ~ Normal(mu, sigma^2 / L).

    That is d_i as the mean of L independent per-token differences of mean mu and standard
    deviation sigma: its spread shrinks as 1/sqrt(L)."""
    lo, hi = mismatch_band(clip[0], clip[1], scale)
    s = sigma / math.sqrt(length)
    if s == 0:
        return float(mu < lo or mu > hi)

    def cdf(x: float) -> float:
        return 0.5 * (1.0 + math.erf((x - mu) / (s * math.sqrt(2.0))))

    return cdf(lo) + (1.0 - cdf(hi))


def expected_safe_length(mu: float, sigma: float, clip: tuple[float, float], tolerance: float,
                         scale: float = 1.0, limit: int = 1 << 26) -> int | None:
    """Shortest L with `expected_share` <= tolerance (None: not below `limit`, e.g. when the
    mean per-token difference itself lies outside the band)."""
    def ok(length: int) -> bool:
        return expected_share(mu, sigma, length, clip, scale) <= tolerance

    hi = 1
    while not ok(hi):
        hi *= 2
        if hi > limit:
            return None
    lo = hi // 2
    while lo + 1 < hi:  # ok(hi), not ok(lo) (or lo == 0)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def safe_length(points: list[dict], key: str = "auto_gspo") -> int | None:
    """Shortest length from which `auto` reuses the engine's log-probs at every longer one."""
    safe = None
    for p in sorted(points, key=lambda p: -p["length"]):
        if p[key] != "rollout":
            break
        safe = p["length"]
    return safe


def truncate(samples, length: int) -> list:
    """Each sample cut to its first `length` response tokens (an MoE engine's routing record,
    one row per token it fed to the model, cut to the prompt and the first `length` - 1)."""
    out = []
    for s in samples:
        cut = {"response_ids": s.response_ids[:length], "finish_reason": "length"}
        for name in ("loss_mask", "rollout_logprobs", "token_versions"):
            if getattr(s, name) is not None:
                cut[name] = getattr(s, name)[:length]
        routing = None if s.routing is None else s.routing[: len(s.prompt_ids) + length - 1]
        out.append(replace(s, routing=routing, **cut))
    return out


def routing_agreement(learner) -> dict:
    """The learner's `moe/routing_agreement/*` of its last forward (share of each token's top-k
    experts that the engine also chose, per layer, over the prompt and response tokens), as
    {"mean", "min", "layers": [...]}; {} for a dense model or without engine routing."""
    if getattr(learner, "routing", None) is None:
        return {}
    m = learner.routing.pop_metrics(torch.device("cpu"))
    layers = [m[k] for k in sorted((k for k in m if k.startswith("moe/routing_agreement/layer_")),
                                   key=lambda k: int(k.rsplit("_", 1)[1]))]
    if not layers:
        return {}
    return {"mean": m["moe/routing_agreement/mean"], "min": m["moe/routing_agreement/min"],
            "layers": layers}


def model_dir_for(path: str, need: int) -> tuple[str, int | None]:
    """`path`, or a temporary copy whose config allows `need` positions (RoPE models only).

    Returns (directory, the original max_position_embeddings when it was raised else None)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    have = int(cfg.get("max_position_embeddings", 0))
    if have >= need:
        return path, None
    d = Path(tempfile.mkdtemp(prefix="precision-sweep-"))
    for f in Path(path).iterdir():
        if f.name != "config.json":
            os.symlink(f.resolve(), d / f.name)
    cfg["max_position_embeddings"] = need
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(d), have


def load_prompts(tok, data: str, n: int, longest: bool = False) -> list[list[int]]:
    """Chat-template token ids of the file's first `n` prompts, or with `longest` of its `n`
    longest (in tokens; ties in file order)."""
    rows = [json.loads(x) for x in open(data) if x.strip()]
    ids = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                   add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for r in rows]
    ids = [p["input_ids"] if hasattr(p, "keys") else p for p in ids]
    if longest:
        order = sorted(range(len(ids)), key=lambda i: (-len(ids[i]), i))
        return [ids[i] for i in order[:n]]
    return ids[:n]


def run(args) -> dict:
    from megatron_gspo.config import load_config
    from megatron_gspo.loop import build
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    pairs = [p.strip() for p in args.pairs.split(",")]
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompts(tok, args.data, args.prompts, args.longest_prompts)
    need = max(len(p) for p in prompts) + max(lengths)
    model_dir, raised = model_dir_for(args.model, need)
    base = load_config(None, [f"model.path={model_dir}", "model.transformer_impl=local",
                              "algorithm.micro_batch_tokens=16384", f"train.seed={args.seed}"])
    gspo_clip = load_config(None, ["algorithm.loss=gspo"]).algorithm.clip_range()
    grpo_clip = load_config(None, ["algorithm.loss=grpo"]).algorithm.clip_range()
    prec = base.precision
    moe = num_routed_experts(json.loads((Path(model_dir) / "config.json").read_text())) > 0
    timing: dict[str, float] = {}
    samples_by_engine = {}
    sp = SamplingParams(max_new_tokens=max(lengths), temperature=1.0, n=args.group,
                        ignore_eos=True)
    for e in sorted({p.split("/")[0] for p in pairs}):
        t0 = time.perf_counter()
        engine = EmbeddedEngine(model_dir, dtype=DTYPE_NAMES[e], seed=args.seed,
                                max_model_len=need, return_routing=moe)
        samples = engine.generate([GenerateRequest(prompt_ids=list(p), sampling=sp)
                                   for p in prompts])
        engine.shutdown()
        if any(len(s.response_ids) != max(lengths) for s in samples):
            raise RuntimeError("a response is not max(lengths) tokens long despite ignore_eos")
        samples_by_engine[e] = samples
        timing[f"generate/{e}"] = time.perf_counter() - t0
        print(f"engine {e}: {len(samples)} responses of {max(lengths)} tokens in "
              f"{timing[f'generate/{e}']:.0f} s", flush=True)
    hf = build.read_hf_config(model_dir)
    points = []
    for ld in sorted({p.split("/")[1] for p in pairs}, key=lambda x: x != "fp32"):
        t0 = time.perf_counter()
        cfg = load_config(None, [f"model.path={model_dir}", "model.transformer_impl=local",
                                 f"model.dtype={DTYPE_NAMES[ld]}", f"train.seed={args.seed}",
                                 "algorithm.micro_batch_tokens=16384"])
        learner = build.learner(cfg, hf)
        build.load_initial_weights(cfg, learner, hf)
        for pair in (p for p in pairs if p.split("/")[1] == ld):
            e = pair.split("/")[0]
            for length in lengths:
                cut = truncate(samples_by_engine[e], length)
                lps = learner.forward_logprobs(cut, temperature=1.0)
                point = measure(pad_rows(lps), pad_rows([s.rollout_logprobs for s in cut]),
                                pad_rows([list(map(float, s.loss_mask)) for s in cut]),
                                gspo_clip=gspo_clip, grpo_clip=grpo_clip,
                                tolerance=prec.tolerance, mismatch_scale=prec.mismatch_scale,
                                audit_fraction=prec.audit_fraction,
                                recheck_interval=prec.recheck_interval)
                agree = routing_agreement(learner)
                if agree:
                    point["routing_agreement"] = agree
                points.append({"pair": pair, "length": length, "sequences": len(cut), **point})
                print(f"{pair} L={length}: d std {point['seq_mismatch_std']:.2e}, GSPO out "
                      f"{point['gspo_seq_out']:.3f}, auto {point['auto_gspo']}", flush=True)
        learner.shutdown()
        timing[f"learner/{ld}"] = time.perf_counter() - t0
    summary = {}
    for pair in pairs:
        pts = [p for p in points if p["pair"] == pair]
        # per-token spread at the longest length: the sigma of the 1/sqrt(L) expectation
        ref = max(pts, key=lambda p: p["length"])
        mu, sigma = ref["token_diff_mean"], ref["token_diff_std"]
        for p in pts:
            p["expected_gspo_seq_out"] = expected_share(mu, sigma, p["length"], gspo_clip,
                                                        prec.mismatch_scale)
        summary[pair] = {"safe_length_gspo": safe_length(pts, "auto_gspo"),
                         "safe_length_grpo": safe_length(pts, "auto_grpo"),
                         "token_diff_mean": mu, "token_diff_std": sigma,
                         "expected_safe_length_gspo": expected_safe_length(
                             mu, sigma, gspo_clip, prec.tolerance, prec.mismatch_scale)}
    return {"points": points, "summary": summary, "timing_s": timing,
            "settings": {"model": args.model, "data": args.data, "prompts": len(prompts),
                         "longest_prompts": args.longest_prompts,
                         "group": args.group, "seed": args.seed, "lengths": lengths,
                         "pairs": pairs, "gspo_clip": gspo_clip, "grpo_clip": grpo_clip,
                         "tolerance": prec.tolerance, "mismatch_scale": prec.mismatch_scale,
                         "max_position_embeddings_raised_from": raised,
                         "threads": args.threads, "torch": torch.__version__,
                         "machine": f"{platform.machine()} {os.cpu_count()} cpus"}}


def markdown(result: dict) -> str:
    """The page's tables: every point, and the safe length per pair."""
    lines = ["| pair (engine/learner) | L | token abs diff mean / max | d_i mean / std | "
             "GSPO seq. out | expected (1/sqrt(L)) | GRPO tokens out | auto (GSPO) | "
             "auto (GRPO) |", "|" + " --- |" * 9]
    for p in result["points"]:
        lines.append(
            f"| {p['pair']} | {p['length']} | {p['token_abs_diff_mean']:.2e} / "
            f"{p['token_abs_diff_max']:.2e} | {p['seq_mismatch_mean']:.1e} / "
            f"{p['seq_mismatch_std']:.1e} | {p['gspo_seq_out']:.3f} | "
            f"{p['expected_gspo_seq_out']:.3f} | {p['grpo_token_out']:.4f} | {p['auto_gspo']} "
            f"| {p['auto_grpo']} |")
    lines += ["", "| pair | per-token diff mean / std | reuse safe from L (GSPO, measured) | "
              "expected from L (1/sqrt(L)) | reuse safe from L (GRPO) |", "|" + " --- |" * 5]
    for pair, s in result["summary"].items():
        lines.append(f"| {pair} | {s['token_diff_mean']:.1e} / {s['token_diff_std']:.1e} | "
                     f"{s['safe_length_gspo'] or 'not in range'} | "
                     f"{s['expected_safe_length_gspo'] or 'beyond 2^26'} | "
                     f"{s['safe_length_grpo'] or 'not in range'} |")
    routed = [p for p in result["points"] if p.get("routing_agreement")]
    if routed:
        lines += ["", "| pair (engine/learner) | L | top-k experts shared, mean / min layer | "
                  "routed elsewhere (1 - mean) | per layer |", "|" + " --- |" * 5]
        for p in routed:
            a = p["routing_agreement"]
            lines.append(f"| {p['pair']} | {p['length']} | {a['mean']:.4f} / {a['min']:.4f} | "
                         f"{1 - a['mean']:.4f} | "
                         f"{' '.join(f'{x:.4f}' for x in a['layers'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="examples/long/base")
    ap.add_argument("--data", default="examples/long/data/eval.jsonl")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--longest-prompts", action="store_true",
                    help="take the file's --prompts longest prompts, not its first (a task whose "
                    "answers grow with the prompt then answers in-distribution at long lengths)")
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    ap.add_argument("--pairs", default=",".join(DEFAULT_PAIRS))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/results/precision-sweep")
    args = ap.parse_args()
    t0 = time.time()
    result = run(args)
    result["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    from bench.precision_sweep_plot import plot

    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    print(f"wall {result['wall_s']:.0f} s; {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    n_safe = sum(s["safe_length_gspo"] is not None for s in result["summary"].values())
    print(f"ratio={n_safe / len(result['summary']):.3f}")


if __name__ == "__main__":
    main()
