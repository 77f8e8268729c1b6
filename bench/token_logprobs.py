"""Benchmark: chunked token log-probs vs materialised `log_softmax(...).gather(...)`.

Measures, for each (tokens, vocab, dtype) case, the peak memory beyond the logits themselves
and the median time of
- the forward of `algo.logprobs.token_logprobs` (rollout-side and loss code) against the
  materialised forward;
- forward + backward of the learner's `megatron.tp_logprobs.vocab_parallel_logprobs` (one TP rank),
  whose autograd backward recomputes the softmax chunk by chunk into the gradient, against
  forward + backward of the materialised log-softmax (the gradient of the logits is in both).
Each measurement runs in a fresh subprocess so peak RSS (CPU) or peak allocated memory (CUDA)
belongs to that method alone.

    python bench/token_logprobs.py [--repeats 3] [--small-only] [--cases 256x1000:float32,...]
        [--json OUT.json]

The last line is `ratio_memory=<x> ratio_time=<y>` of the forward for the last float32 case
(ours / materialised; targets: memory <= 0.25, time <= 1.2); the rows carry the learner's
forward + backward ratios as `learner_ratio_memory` / `learner_ratio_time`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

CASES = [(1024, 151_936, "float32"), (1024, 151_936, "bfloat16"),
         (8192, 151_936, "float32"), (8192, 151_936, "bfloat16")]
# forward + backward: the learner's vocab_parallel_logprobs and the materialised reference
BACKWARD_METHODS = ("learner", "learner_materialised")


def _child(tokens: int, vocab: int, dtype: str, method: str, repeats: int) -> dict:
    import psutil
    import torch

    from megatron_gspo.algo.logprobs import token_logprobs
    from megatron_gspo.megatron.tp_logprobs import vocab_parallel_logprobs

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    backward = method in BACKWARD_METHODS
    logits = torch.empty(tokens, vocab, dtype=getattr(torch, dtype), device=dev)
    logits.normal_(0, 3)
    logits.requires_grad_(backward)
    targets = torch.randint(0, vocab, (tokens,), device=dev)

    def materialised():
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]

    def run():
        if method == "chunked":
            return token_logprobs(logits, targets)
        if method == "materialised":
            return materialised()
        lp = vocab_parallel_logprobs(logits, targets) if method == "learner" else materialised()
        lp.sum().backward()  # [N] -> the logits' gradient, [N, V]
        out, logits.grad = logits.grad, None
        return out

    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = psutil.Process().memory_info().rss
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out
    if dev == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"extra_bytes": max(peak - base, 0), "time_s": statistics.median(times),
            "logits_bytes": logits.numel() * logits.element_size(), "device": dev}


def parse_cases(text: str) -> list[tuple[int, int, str]]:
    """`1024x151936:float32,256x1000:bfloat16` -> [(1024, 151936, "float32"), ...]."""
    out = []
    for item in text.split(","):
        try:
            shape, dtype = item.split(":")
            tokens, vocab = (int(v) for v in shape.split("x"))
        except ValueError:
            raise SystemExit(f"--cases: bad case {item!r}; expected TOKENSxVOCAB:DTYPE") from None
        if dtype not in ("float32", "bfloat16", "float16"):
            raise SystemExit(f"--cases: bad dtype {dtype!r} in {item!r}")
        out.append((tokens, vocab, dtype))
    return out


def _measure(tokens, vocab, dtype, method, repeats):
    code = (f"import json, sys; sys.path.insert(0, {sys.path[0]!r}); "
            f"from bench.token_logprobs import _child; "
            f"print(json.dumps(_child({tokens}, {vocab}, {dtype!r}, {method!r}, {repeats})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=_repo_root())
    if out.returncode != 0:
        raise SystemExit(f"benchmark child failed ({method}, {tokens}x{vocab} {dtype}):\n"
                         f"{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _repo_root():
    from pathlib import Path

    return str(Path(__file__).resolve().parent.parent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small-only", action="store_true", help="skip the 8192-token cases")
    ap.add_argument("--cases", default=None,
                    help="comma-separated TOKENSxVOCAB:DTYPE cases instead of the default set")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    cases = parse_cases(args.cases) if args.cases else CASES
    cases = [c for c in cases if not (args.small_only and c[0] > 1024)]
    if not any(c[2] == "float32" for c in cases):
        ap.error("at least one float32 case is needed for the ratio line")
    gib = 2**30
    print(f"{'tokens':>7} {'vocab':>8} {'dtype':>9} {'pass':>8} {'logits GiB':>10} | "
          f"{'chunked +GiB':>12} {'chunked s':>9} | {'material +GiB':>13} {'material s':>10} | "
          f"{'mem ratio':>9} {'time ratio':>10}")
    last, rows = None, []
    for tokens, vocab, dtype in cases:
        row = {"tokens": tokens, "vocab": vocab, "dtype": dtype}
        for label, mine, theirs, prefix in (("fwd", "chunked", "materialised", ""),
                                            ("fwd+bwd", "learner", "learner_materialised",
                                             "learner_")):
            ours = _measure(tokens, vocab, dtype, mine, args.repeats)
            ref = _measure(tokens, vocab, dtype, theirs, args.repeats)
            rm = ours["extra_bytes"] / max(ref["extra_bytes"], 1)
            rt = ours["time_s"] / ref["time_s"]
            print(f"{tokens:>7} {vocab:>8} {dtype:>9} {label:>8} "
                  f"{ours['logits_bytes'] / gib:>10.2f} | {ours['extra_bytes'] / gib:>12.3f} "
                  f"{ours['time_s']:>9.3f} | {ref['extra_bytes'] / gib:>13.3f} "
                  f"{ref['time_s']:>10.3f} | {rm:>9.3f} {rt:>10.3f}", flush=True)
            mine = "chunked" if not prefix else "learner"
            row.update({"logits_gib": ours["logits_bytes"] / gib,
                        f"{mine}_extra_gib": ours["extra_bytes"] / gib,
                        f"{mine}_s": ours["time_s"],
                        f"{prefix}materialised_extra_gib": ref["extra_bytes"] / gib,
                        f"{prefix}materialised_s": ref["time_s"],
                        f"{prefix}ratio_memory": rm, f"{prefix}ratio_time": rt})
            if dtype == "float32" and not prefix:
                last = (rm, rt)
        rows.append(row)
    print(f"device={ours['device']}")
    print(f"ratio_memory={last[0]:.3f} ratio_time={last[1]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": ours["device"], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
