"""GPU check of the Megatron-Core learner: the CPU-proven checks again with CUDA / NCCL and,
where Transformer Engine is installed, the TE layer spec (THD packed attention).

1. reference run on the CPU (gloo, 1 process)            -> ref.pt
2. one GPU, NCCL: local spec (fp32, TF32 off) vs the reference (log-probs, loss, GSPO clip
   statistics, gradients, parameters after one Adam step); TE spec in bf16 when installed;
   the dense model first, then the MoE model, each passing or failing on its own ("gpu.dense",
   "gpu.moe" in --json)
3. with >= 4 GPUs: the 4-rank layout checks (TP/PP/VPP/EP/SP/DP, vocab-parallel log-probs,
   CP reduction) on NCCL

    python scripts/gpu_learner_check.py [--out DIR] [--reference REF.pt] [--json OUT.json]
    python scripts/gpu_learner_check.py --reference-only --out DIR     # CPU machine: DIR/ref.pt

The CPU reference needs the CPU layer of `megatron_gspo.megatron.cpu` (torch >= 2.13). A GPU
machine with an older torch uses a reference made elsewhere: `--reference-only` writes it on a
CPU machine (`scripts/gpu_wheels.sh` does), `--reference` reads it. The reference holds only
tiny models and inputs drawn from fixed seeds, so it is the same wherever it is made.

Prints one line per stage and every failed comparison; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "scripts"))

import repo_tests  # noqa: E402

repo_tests.bind()  # `tests` is this repository's folder, whatever else is on the path
from tests.megatron._dist import launch  # noqa: E402


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment additions for the worker processes: this repository first on PYTHONPATH,
    then the caller's PYTHONPATH (where packages installed with `pip --target` live)."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), **(extra or {})}


def cpu_layer_usable() -> bool:
    """Whether this torch can run the CPU reference (`megatron_gspo.megatron.cpu` needs it)."""
    import torch

    return hasattr(torch.overrides, "redispatch_function")


def compact(path: Path) -> int:
    """Re-save a reference with every tensor cloned: views into large gradient buffers would
    otherwise carry their whole storage. Returns the new file size in bytes."""
    import torch

    def clone(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: clone(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(clone(v) for v in x)
        return x

    data = clone(torch.load(path, weights_only=False))
    tmp = path.with_suffix(".tmp")
    torch.save(data, tmp)
    tmp.replace(path)
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--reference", default=None,
                    help="a ref.pt made by --reference-only (skips the CPU reference run)")
    ap.add_argument("--reference-only", action="store_true",
                    help="only run the CPU reference and write OUT/ref.pt")
    ap.add_argument("--json", default=None, help="also write the stages' results here")
    args = ap.parse_args(argv)
    import torch

    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_learner_check_"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    failures: list[str] = []

    def finish(code: int) -> int:
        if args.json:
            Path(args.json).write_text(json.dumps({"stages": results, "failures": failures},
                                                  indent=1))
        return code

    cuda = torch.cuda.is_available()
    if not cuda and not args.reference_only:
        print("no CUDA device: nothing to check on GPU")
        results["gpu"] = {"status": "skipped: no CUDA"}
        return finish(0)
    stages: list[tuple[str, int, dict]] = []
    if args.reference:
        ref = Path(args.reference)
        if not ref.is_file():
            print(f"--reference {ref}: no such file")
            failures.append(f"--reference {ref}: no such file")
            return finish(1)
        if ref.resolve() != (out / "ref.pt").resolve():
            shutil.copyfile(ref, out / "ref.pt")
        print(f"[ref] from {ref}")
        results["ref"] = {"status": "given", "path": str(ref)}
    elif not cpu_layer_usable():
        msg = (f"torch {torch.__version__} cannot run the CPU reference (the CPU layer needs "
               "torch >= 2.13): make it on a CPU machine with --reference-only "
               "(scripts/gpu_wheels.sh does) and pass --reference")
        print(f"[ref] FAILED: {msg}")
        results["ref"] = {"status": "FAIL", "error": msg}
        failures.append(msg)
        return finish(1)
    else:
        stages.append(("ref", 1, worker_env()))
    if not args.reference_only:
        stages.append(("gpu", 1, worker_env({"CUDA_VISIBLE_DEVICES": "0"})))
        gpus = torch.cuda.device_count()
        if gpus >= 4:
            visible = ",".join(str(i) for i in range(gpus))
            stages.append(("par", 4, worker_env({"CUDA_VISIBLE_DEVICES": visible})))
        else:
            print(f"{gpus} GPU(s): the 4-rank NCCL layout checks need 4, skipped")
            results["par"] = {"status": f"skipped: {gpus} GPU(s), needs 4"}
    for case, n, env in stages:
        try:
            reports = launch(case, n, out, timeout=600, extra_env=env)
        except AssertionError as e:
            print(f"[{case}] FAILED TO RUN\n{e}")
            failures.append(f"{case}: failed to run")
            results[case] = {"status": "FAIL", "error": str(e).splitlines()[0]}
            continue
        fails = [f for r in reports for f in r["failures"]]
        print(f"[{case}] ranks={n} failures={len(fails)} info={json.dumps(reports[0]['info'])}")
        for f in fails:
            print(f"  - {f}")
        failures += fails
        results[case] = {"status": "FAIL" if fails else "ok", "failures": fails,
                         "info": reports[0]["info"]}
        for model, status in reports[0]["info"].get("models", {}).items():  # dense first
            print(f"  [{case}] {model}: {status}")
            results[f"{case}.{model}"] = {"status": status}
    print("OK" if not failures else f"{len(failures)} failure(s)")
    if args.reference_only and not failures:
        size = compact(out / "ref.pt")
        print(f"reference: {out / 'ref.pt'} ({size / 2**20:.1f} MiB)")
    return finish(1 if failures else 0)


if __name__ == "__main__":
    sys.exit(main())
