"""GPU node self-check for the megatron-gspo image: CUDA, NCCL, Transformer Engine, apex,
megatron-core, one Transformer-Engine-spec GPTModel forward/backward, and an SGLang server
round trip. Prints one table; exits 1 if any check failed, 0 otherwise.

    python tools/gpu_selfcheck.py [--sglang-model DIR] [--json OUT.json] [--allow-missing]

Without a CUDA device the GPU rows read "skipped: no CUDA" and the exit code is 0, so the same
command works in CI and on a login node. Inside the image a missing Transformer Engine is a
failure, and so is a missing apex unless Transformer Engine is there (megatron-core 0.17+ takes
FusedAdam and the multi-tensor kernels from it first; the image has no apex); `--allow-missing`
reports both as skipped instead (a bare GPU machine with torch only, as `scripts/gpu_checks.sh`
uses). SGLang is skipped when it is not installed. Each check that
touches the GPU runs in its own spawned process with a time limit, so one hang or crash cannot
take the others down.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

NO_CUDA = "skipped: no CUDA"


@dataclass
class Row:
    """One line of the report."""

    check: str
    status: str  # "ok" | "FAIL" | "skipped: <why>"
    detail: str = ""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1, at most 55535: SGLang 0.5.12 sets
    grpc_port = port + 10000 for every server and refuses one above 65535 (the launcher's
    `pick_ports` keeps to that bound)."""
    from megatron_gspo.rollout.sglang.launch import pick_ports

    return pick_ports("127.0.0.1", 0, 1)[0]


def run_isolated(fn, nprocs: int, timeout_s: float, *args) -> list:
    """Run fn(rank, nprocs, queue, *args) in `nprocs` spawned processes and collect one result each.

    Args:
        fn: module-level function; must put one (rank, ok, detail) tuple on the queue.
        nprocs: number of processes (one per GPU for collectives).
        timeout_s: wall-clock limit for all of them.
    Returns:
        the results sorted by rank; a missing result becomes (rank, False, reason).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=fn, args=(r, nprocs, queue, *args), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    timed_out = any(p.is_alive() for p in procs)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = {}
    while not queue.empty():
        rank, ok, detail = queue.get()
        results[rank] = (rank, ok, detail)
    for r, p in enumerate(procs):
        if r not in results:
            why = f"timed out after {timeout_s:.0f}s" if timed_out else f"exit code {p.exitcode}"
            results[r] = (r, False, f"rank {r}: {why}")
    return [results[r] for r in range(nprocs)]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


# ----------------------------------------------------------------------------- NCCL all-reduce


def _nccl_worker(rank: int, world: int, queue, port: int, mbytes: int) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
        numel = mbytes * 2**20 // 4
        x = torch.full((numel,), float(rank + 1), device="cuda")  # [numel]
        dist.all_reduce(x)
        torch.cuda.synchronize()
        expect = world * (world + 1) / 2
        ok = bool(torch.all(x == expect).item())
        iters = 5
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        # Bus bandwidth as NCCL's tests define it: 2 (n - 1) / n * bytes / time.
        busbw = (2 * (world - 1) / world * numel * 4 / dt / 1e9) if world > 1 else 0.0
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        detail = (f"{world} GPU(s), NCCL {nccl}, sum={'correct' if ok else 'WRONG'}, "
                  f"{mbytes} MiB in {dt * 1e3:.2f} ms, busbw {busbw:.0f} GB/s")
        dist.destroy_process_group()
        queue.put((rank, ok, detail))
    except BaseException as e:  # noqa: BLE001 - report any failure, never hang the parent
        queue.put((rank, False, _error(e)))


def check_nccl(ngpu: int, timeout_s: float) -> Row:
    """All-reduce across every local GPU through torch.distributed (NCCL backend)."""
    res = run_isolated(_nccl_worker, ngpu, timeout_s, free_port(), 256)
    bad = [d for _, ok, d in res if not ok]
    return Row("nccl all-reduce", "FAIL" if bad else "ok", bad[0] if bad else res[0][2])


# ----------------------------------------------------------------------------- imports


def check_te(allow_missing: bool = False) -> Row:
    """Transformer Engine imports with its PyTorch extension and runs one fused Linear.

    Args:
        allow_missing: a Transformer Engine that is not installed is skipped, not a failure.
    """
    try:
        import torch
        import transformer_engine
        import transformer_engine.pytorch as te

        lin = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
        x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        lin(x).float().sum().backward()
        ok = x.grad is not None and bool(torch.isfinite(x.grad).all())
        return Row("transformer-engine", "ok" if ok else "FAIL",
                   f"{transformer_engine.__version__}, te.Linear fwd/bwd "
                   f"{'finite' if ok else 'NOT finite'}")
    except ImportError as e:
        if allow_missing and importlib.util.find_spec("transformer_engine") is None:
            return Row("transformer-engine", "skipped: not installed")
        return Row("transformer-engine", "FAIL", f"not importable: {_error(e)}")
    except Exception as e:  # noqa: BLE001 - any failure is a FAIL row
        return Row("transformer-engine", "FAIL", _error(e))


def _te_fused_adam() -> bool:
    """Transformer Engine's FusedAdam imports (megatron-core prefers it to apex's)."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken: apex is then needed
        return False
    return True


def check_apex(allow_missing: bool = False) -> Row:
    """apex with its CUDA extensions: amp_C, fused layer norm, and one FusedAdam step.

    Args:
        allow_missing: an apex that is not installed is skipped, not a failure.
    """
    try:
        import torch
        from apex.optimizers import FusedAdam

        missing = [m for m in ("amp_C", "fused_layer_norm_cuda")
                   if importlib.util.find_spec(m) is None]
        if missing:
            return Row("apex", "FAIL", f"CUDA extensions missing: {', '.join(missing)} "
                       "(apex built without --cuda_ext)")
        p = torch.nn.Parameter(torch.ones(4096, device="cuda"))
        p.grad = torch.ones_like(p)
        FusedAdam([p], lr=0.1).step()
        moved = bool(torch.allclose(p.detach(), torch.full_like(p, 0.9), atol=1e-4))
        return Row("apex", "ok" if moved else "FAIL",
                   f"amp_C + fused_layer_norm_cuda present, FusedAdam step "
                   f"{'correct' if moved else 'WRONG'}")
    except ImportError as e:
        if allow_missing and importlib.util.find_spec("apex") is None:
            return Row("apex", "skipped: not installed")
        if importlib.util.find_spec("apex") is None and _te_fused_adam():
            return Row("apex", "skipped: not installed (Transformer Engine's FusedAdam is used)")
        return Row("apex", "FAIL", f"not importable: {_error(e)}")
    except Exception as e:  # noqa: BLE001 - any failure is a FAIL row
        return Row("apex", "FAIL", _error(e))


def check_megatron(cuda: bool) -> Row:
    """megatron-core: imported on GPU nodes; without CUDA only its installed version is read."""
    if not cuda:
        try:
            return Row("megatron-core", "ok", f"{importlib.metadata.version('megatron-core')} "
                       "installed (import checked on GPU nodes)")
        except importlib.metadata.PackageNotFoundError:
            return Row("megatron-core", "FAIL", "not installed")
    try:
        import megatron.core

        return Row("megatron-core", "ok", f"{megatron.core.__version__}")
    except Exception as e:  # noqa: BLE001 - any failure is a FAIL row
        return Row("megatron-core", "FAIL", f"not importable: {_error(e)}")


# ----------------------------------------------------------------------------- TE-spec GPTModel


def _gpt_worker(rank: int, world: int, queue, port: int) -> None:
    try:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)
        # A two-layer Qwen3-shaped model: GQA, QK-norm, RMSNorm, SwiGLU, RoPE, no biases.
        cfg = TransformerConfig(
            num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
            num_query_groups=2, kv_channels=32, normalization="RMSNorm", qk_layernorm=True,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        )
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
        vocab, seq = 1024, 128
        model = GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=seq,
                         position_embedding_type="rope").cuda()
        ids = torch.randint(0, vocab, (2, seq), device="cuda")  # [B, T]
        pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(2, -1)  # [B, T]
        t0 = time.perf_counter()
        loss = model(ids, pos, attention_mask=None, labels=ids)  # [B, T] per-token loss
        loss.float().mean().backward()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        params = [p for p in model.parameters() if p.requires_grad]
        no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None
                   and getattr(p, "main_grad", None) is None]
        finite = bool(torch.isfinite(loss).all()) and all(
            bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
        ok = finite and not no_grad
        layer_cls = type(model.decoder.layers[0].self_attention.linear_qkv).__name__
        ln_v = math.log(vocab)  # loss of a uniform guess; a random-init model starts near it
        detail = (f"loss {loss.float().mean().item():.3f} (ln V = {ln_v:.3f}), "
                  f"{'finite' if finite else 'NOT finite'}, "
                  f"{len(params) - len(no_grad)}/{len(params)} params got grads, "
                  f"qkv={layer_cls}, {dt * 1e3:.0f} ms")
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        queue.put((rank, ok, detail))
    except BaseException as e:  # noqa: BLE001 - report any failure, never hang the parent
        queue.put((rank, False, _error(e)))


def check_gpt(timeout_s: float) -> Row:
    """One forward/backward of a tiny GPTModel built from the Transformer Engine layer spec."""
    (_, ok, detail), = run_isolated(_gpt_worker, 1, timeout_s, free_port())
    return Row("TE-spec GPTModel fwd/bwd", "ok" if ok else "FAIL", detail)


# ----------------------------------------------------------------------------- SGLang


def check_sglang(model_dir: str | None, timeout_s: float, *args, **kwargs) -> Row:
    """The SGLang server round trip (`gpu_selfcheck_sglang.check_sglang`)."""
    from gpu_selfcheck_sglang import check_sglang as run

    return run(model_dir, timeout_s, *args, **kwargs)


def run_checks(sglang_model: str | None, timeout_s: float,
               sglang_module: str = "sglang.launch_server",
               allow_missing: bool = False) -> tuple[list[Row], bool]:
    """All checks in order. Returns (rows, cuda_available).

    Args:
        allow_missing: Transformer Engine / apex that are not installed are skipped rows.
    """
    import torch

    rows = [Row("torch", "ok", f"{torch.__version__}, built for CUDA {torch.version.cuda}")]
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if cuda:
        n = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
        free, total = torch.cuda.mem_get_info(0)
        rows.append(Row("cuda devices", "ok", f"{n} x {', '.join(names)} (sm {cap}), "
                        f"GPU 0: {free / 2**30:.0f}/{total / 2**30:.0f} GiB free"))
        rows.append(check_nccl(n, timeout_s))
        rows.append(check_te(allow_missing))
        rows.append(check_apex(allow_missing))
    else:
        rows += [Row(c, NO_CUDA) for c in ("cuda devices", "nccl all-reduce",
                                           "transformer-engine", "apex")]
    rows.append(check_megatron(cuda))
    if cuda and allow_missing and importlib.util.find_spec("transformer_engine") is None:
        rows.append(Row("TE-spec GPTModel fwd/bwd", "skipped: Transformer Engine not installed"))
        rows.append(check_sglang(sglang_model, timeout_s, sglang_module))
    elif cuda:
        rows.append(check_gpt(timeout_s))
        rows.append(check_sglang(sglang_model, timeout_s, sglang_module))
    else:
        rows += [Row("TE-spec GPTModel fwd/bwd", NO_CUDA), Row("sglang server round trip", NO_CUDA)]
    return rows, cuda


def format_table(rows: list[Row]) -> str:
    """Rows as an aligned plain-text table."""
    w1 = max(len("check"), *(len(r.check) for r in rows))
    w2 = max(len("status"), *(len(r.status) for r in rows))
    lines = [f"{'check':<{w1}}  {'status':<{w2}}  detail", f"{'-' * w1}  {'-' * w2}  ------"]
    lines += [f"{r.check:<{w1}}  {r.status:<{w2}}  {r.detail}".rstrip() for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-model", default=None,
                    help="Hugging Face model directory for the SGLang round trip (a small "
                         "model), or 'tiny' for a tiny random Qwen3 built on the spot")
    ap.add_argument("--sglang-module", default="sglang.launch_server",
                    help="server module run with SGLang's launch flags (default: SGLang's)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds allowed for each GPU check (default 600)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--allow-missing", action="store_true",
                    help="report a Transformer Engine or apex that is not installed as skipped "
                         "instead of failed (a bare GPU machine, not the image)")
    args = ap.parse_args(argv)
    rows, cuda = run_checks(args.sglang_model, args.timeout, args.sglang_module,
                            args.allow_missing)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cuda": cuda, "rows": [asdict(r) for r in rows]}, f, indent=1)
    failed = [r.check for r in rows if r.status == "FAIL"]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    if not cuda:
        print("\nNo CUDA device visible: the GPU checks were skipped. Run this on a GPU node "
              "(inside the image) for the full check.")
    else:
        print("\nAll checks passed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
