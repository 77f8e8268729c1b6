"""Benchmark: chunked `token_logprobs` vs materialised `log_softmax(...).gather(...)`.

Measures, for each (tokens, vocab, dtype) case, the peak memory beyond the logits themselves
and the median forward time of both methods. Each measurement runs in a fresh subprocess so
peak RSS (CPU) or peak allocated memory (CUDA) belongs to that method alone.

    python bench/token_logprobs.py [--repeats 3] [--small-only] [--cases 256x1000:float32,...]
        [--json OUT.json]

The last line is `ratio_memory=<x> ratio_time=<y>` for the last float32 case
(ours / materialised; targets: memory <= 0.25, time <= 1.2).
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


def _child(tokens: int, vocab: int, dtype: str, method: str, repeats: int) -> dict:
    import psutil
    import torch

    from megatron_gspo.algo.logprobs import token_logprobs

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.empty(tokens, vocab, dtype=getattr(torch, dtype), device=dev)
    logits.normal_(0, 3)
    targets = torch.randint(0, vocab, (tokens,), device=dev)

    def run():
        if method == "chunked":
            return token_logprobs(logits, targets)
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]

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
    print(f"{'tokens':>7} {'vocab':>8} {'dtype':>9} {'logits GiB':>10} | "
          f"{'chunked +GiB':>12} {'chunked s':>9} | {'material +GiB':>13} {'material s':>10} | "
          f"{'mem ratio':>9} {'time ratio':>10}")
    last, rows = None, []
    for tokens, vocab, dtype in cases:
        ours = _measure(tokens, vocab, dtype, "chunked", args.repeats)
        ref = _measure(tokens, vocab, dtype, "materialised", args.repeats)
        rm = ours["extra_bytes"] / max(ref["extra_bytes"], 1)
        rt = ours["time_s"] / ref["time_s"]
        print(f"{tokens:>7} {vocab:>8} {dtype:>9} {ours['logits_bytes'] / gib:>10.2f} | "
              f"{ours['extra_bytes'] / gib:>12.3f} {ours['time_s']:>9.3f} | "
              f"{ref['extra_bytes'] / gib:>13.3f} {ref['time_s']:>10.3f} | "
              f"{rm:>9.3f} {rt:>10.3f}", flush=True)
        rows.append({"tokens": tokens, "vocab": vocab, "dtype": dtype,
                     "logits_gib": ours["logits_bytes"] / gib,
                     "chunked_extra_gib": ours["extra_bytes"] / gib,
                     "chunked_s": ours["time_s"],
                     "materialised_extra_gib": ref["extra_bytes"] / gib,
                     "materialised_s": ref["time_s"], "ratio_memory": rm, "ratio_time": rt})
        if dtype == "float32":
            last = (rm, rt)
    print(f"device={ours['device']}")
    print(f"ratio_memory={last[0]:.3f} ratio_time={last[1]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": ours["device"], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
