"""Self-check of the megatron-gspo image (both flavours), run at the end of the build and by hand:

    docker run --rm IMAGE python3 docker/selfcheck.py

Checks: every pinned package (/etc/megatron-gspo-pins.txt, written by the build from the lock
file and the version ARGs) is installed at its pin, `pip check` reports nothing new (the gpu
build records what it reports on SGLang's image before adding anything), torch and megatron-core
import, the `megatron-gspo` CLI starts, the launch scripts are on PATH and build a torchrun
command, then tools/gpu_selfcheck.py's table (CUDA, NCCL, Transformer Engine, apex, a TE-spec
GPTModel, SGLang: "skipped: no CUDA" without a GPU; the cpu flavour has no Transformer Engine,
so it passes --allow-missing). Prints one table; exit code 1 when a check failed.

    python3 docker/selfcheck.py --only-base sglang==0.5.23 torch==2.14.1

checks only those installed versions (the GPU build's first step, on the base image).
Versions are compared without their local label (torch 2.13.0+cpu is release 2.13.0).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINS = Path("/etc/megatron-gspo-pins.txt")
PIPCHECK_BASE = Path("/etc/megatron-gspo-pipcheck-base.txt")  # gpu: the base image's own
LAUNCH = ("torchrun.sh", "colocated.sh", "disaggregated.sh", "slurm.sbatch")


def public(version: str) -> str:
    """The version without its local label: 2.13.0+cpu -> 2.13.0."""
    from packaging.version import Version

    return Version(version).public


def check_pins(lines: list[str]) -> list[tuple[str, bool, str]]:
    """One row per `name==version` line: installed, and at the pinned version."""
    rows = []
    for line in lines:
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, _, pin = line.partition("==")
        try:
            got = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            rows.append((f"pin {name}", False, f"not installed (pinned {pin})"))
            continue
        ok = public(got) == public(pin)
        rows.append((f"pin {name}", ok, got if ok else f"installed {got}, pinned {pin}"))
    return rows


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, **kw)


def pip_check_row(returncode: int, out: str, inherited: set[str]) -> tuple[str, bool, str]:
    """`pip check`'s verdict: only problems the base image did not already have fail it."""
    found = [ln for ln in out.splitlines() if ln.strip()]
    new = [ln for ln in found if ln not in inherited]
    if returncode == 0:
        return ("pip check", True, "No broken requirements found.")
    if found and not new:
        return ("pip check", True, f"{len(found)} problems inherited from the base image, none new")
    return ("pip check", False, "; ".join(new[:3]) or out.strip()[-200:])


def check_install() -> list[tuple[str, bool, str]]:
    """pip check, the imports, the CLI and the launch scripts."""
    r = run([sys.executable, "-m", "pip", "check"])
    inherited = set(PIPCHECK_BASE.read_text().splitlines()) if PIPCHECK_BASE.is_file() else set()
    rows = [pip_check_row(r.returncode, r.stdout, inherited)]
    r = run([sys.executable, "-c", "import torch, megatron.core as m; "
             "print(torch.__version__, m.__version__)"])
    rows.append(("import torch, megatron.core", r.returncode == 0,
                 (r.stdout or r.stderr).strip().splitlines()[-1]))
    cli = shutil.which("megatron-gspo")
    r = run([cli, "--version"]) if cli else None
    rows.append(("megatron-gspo --version", bool(r and r.returncode == 0),
                 (r.stdout.strip() if r and r.returncode == 0 else
                  (r.stderr.strip()[-200:] if r else "not on PATH"))))
    missing = [s for s in LAUNCH if not shutil.which(s)]
    rows.append(("launch scripts on PATH", not missing,
                 f"missing: {', '.join(missing)}" if missing else ", ".join(LAUNCH)))
    if not missing:
        env = {**os.environ, "GPUS_PER_NODE": "1"}
        r = run([shutil.which("torchrun.sh"), "--dry-run", "config.yaml"], env=env)
        rows.append(("torchrun.sh --dry-run", r.returncode == 0 and "torchrun" in r.stdout,
                     r.stdout.strip()[:120] or r.stderr.strip()[-200:]))
    return rows


def gpu_table(flavor: str) -> tuple[bool, str]:
    """tools/gpu_selfcheck.py's table (its exit code says whether a row failed)."""
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_selfcheck.py")]
    if flavor == "cpu":
        cmd.append("--allow-missing")
    r = run(cmd)
    return r.returncode == 0, (r.stdout + r.stderr).strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only-base", nargs="+", metavar="NAME==VERSION",
                    help="check only these installed versions and stop")
    ap.add_argument("--pins", type=Path, default=PINS, help=f"pins file (default {PINS})")
    ap.add_argument("--flavor", default=os.environ.get("MEGATRON_GSPO_IMAGE", "gpu"),
                    choices=["cpu", "gpu"], help="image flavour (default $MEGATRON_GSPO_IMAGE)")
    args = ap.parse_args(argv)
    if args.only_base:
        rows = check_pins(args.only_base)
    else:
        if not args.pins.is_file():
            print(f"selfcheck: no pins file {args.pins} (not inside the image?)", file=sys.stderr)
            return 1
        pins = check_pins(list(dict.fromkeys(args.pins.read_text().splitlines())))  # once each
        rows = check_install()
        bad = [r for r in pins if not r[1]]
        rows.insert(0, (f"pins ({len(pins)} packages)", not bad,
                        "; ".join(r[2] for r in bad[:3]) if bad else "all at their pin"))
        rows += [r for r in pins if r[0] in ("pin torch", "pin megatron-core", "pin sglang",
                                             "pin transformer-engine", "pin sglang-router")]
    w = max(len(r[0]) for r in rows)
    for name, ok, detail in rows:
        print(f"{name:<{w}}  {'ok' if ok else 'FAIL':<4}  {detail}")
    failed = [r[0] for r in rows if not r[1]]
    if not args.only_base:
        ok, table = gpu_table(args.flavor)
        print(f"\ntools/gpu_selfcheck.py ({args.flavor} image):\n{table}")
        if not ok:
            failed.append("tools/gpu_selfcheck.py")
    if failed:
        print(f"selfcheck: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("selfcheck: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
