"""Benchmark: where a checkpoint's time goes (issue 45). Runs one training in this process with
timers around each stage of a save (ours and Megatron-Core's dist-checkpointing), and prints,
per stage, how often it ran and the seconds it held the training loop, per checkpoint.

Stages (inclusive times; a stage inside another is indented): the non-finite check, the
learner's sharded state dict (model + optimizer), Megatron's `save` (its preprocess with the
access-integrity check, `common.pt`, the async plan with its metadata gather, the writer's
staging), scheduling the writer (fork or hand-off to the persistent worker), the per-step poll
and the finalize (write-result gather, `.metadata`, our COMPLETE manifest), barriers. The
writer processes' own CPU seconds (`writer cpu`, children's rusage) are what competes with
training for the cores; `load` is the 1-minute load average at the start and end.

    python bench/checkpoint_profile.py [--config examples/tiny/config.yaml] [--steps 12] \
        [--interval 2] [--sync] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.checkpoint_cost import COMMON, TINY  # noqa: E402

STATS: dict[str, list[float]] = {}
ORDER: list[str] = []


def _wrap(owner, name: str, label: str) -> None:
    """Time every call of `owner.name` under `label` (a missing attribute is skipped: another
    Megatron-Core version)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return
    ORDER.append(label)
    STATS[label] = [0, 0.0]

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            STATS[label][0] += 1
            STATS[label][1] += time.perf_counter() - t

    setattr(owner, name, timed)


def install() -> None:
    """Timers on the stages of a save (see the module docstring)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import serialization as ser
    from megatron.core.dist_checkpointing.strategies import async_utils as au
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    from megatron.core.dist_checkpointing.strategies import torch as mts

    from megatron_gspo.megatron.io import async_save
    from megatron_gspo.megatron.learner_state import LearnerState
    from megatron_gspo.runtime import run_checkpoint as ck

    _wrap(ck.Checkpointer, "save", "checkpoint save (loop)")
    _wrap(ck, "nonfinite_parameters", "  non-finite check")
    _wrap(LearnerState, "save_checkpoint", "  learner save_checkpoint")
    _wrap(LearnerState, "_full_sharded_sd", "    sharded state dict")
    _wrap(ser, "save_preprocess", "    mcore save_preprocess")
    _wrap(mts.TorchDistSaveShardedStrategy, "save", "    mcore torch_dist save (sync)")
    _wrap(mts.TorchDistSaveShardedStrategy, "async_save", "    mcore async_save (plan)")
    _wrap(mts, "save_state_dict_async_plan", "      save plan + gather")
    _wrap(fsa.FileSystemWriterAsync, "prepare_write_data", "      prepare_write_data")
    _wrap(async_save.AsyncSaves, "schedule", "    schedule (writer start)")
    _wrap(au.TemporalAsyncCaller, "schedule_async_call", "      fork writer")
    _wrap(au.PersistentAsyncCaller, "schedule_async_call", "      hand to worker")
    _wrap(async_save.AsyncSaves, "poll", "poll (after each step)")
    _wrap(async_save.AsyncSaves, "wait", "wait (end of run)")
    _wrap(mts, "save_state_dict_async_finalize", "  mcore finalize (gather, .metadata)")
    _wrap(ck.Checkpointer, "_publish", "  publish (manifest, COMPLETE)")
    _wrap(ck, "manifest", "    manifest (sizes, sha256)")
    _wrap(dist, "barrier", "barrier (anywhere)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "tiny" / "config.yaml"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--sync", action="store_true", help="synchronous saves")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    extra = args.overrides or (TINY if args.config.endswith("tiny/config.yaml") else [])
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    from megatron_gspo.cli import main as cli

    install()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ckpt_prof_") as tmp:
        t0 = time.perf_counter()
        rc = cli(["train", args.config, "--run-dir", str(Path(tmp) / "run"),
                  f"train.max_steps={args.steps}", f"checkpoint.interval={args.interval}",
                  f"checkpoint.async_save={str(not args.sync).lower()}", *COMMON, *extra])
        wall = time.perf_counter() - t0
    if rc:
        sys.exit(f"checkpoint_profile: training failed (exit {rc})")
    saves = max(1, STATS["checkpoint save (loop)"][0])
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{Path(args.config).parent.name}: {args.steps} steps, {saves} checkpoints "
          f"({'sync' if args.sync else 'async'}), {wall:.1f} s; load {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'stage':40s} {'calls':>6s} {'s in all':>9s} {'s / ckpt':>9s}")
    for label in ORDER:
        n, s = STATS[label]
        if n:
            print(f"{label:40s} {n:6d} {s:9.3f} {s / saves:9.3f}")
    print(f"{'writer cpu (children user+sys)':40s} {'':6s} "
          f"{kids.ru_utime + kids.ru_stime:9.3f} {(kids.ru_utime + kids.ru_stime) / saves:9.3f}")


if __name__ == "__main__":
    main()
