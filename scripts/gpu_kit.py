"""Helpers of `scripts/gpu_checks.sh`: the kit folder's check and offline install, the markdown
summary of a run (the format of docs/gpu-results.md), and inserting a summary into that file.

    python scripts/gpu_kit.py kit --kit .whl --target DIR [--cross] [--json OUT.json]
    python scripts/gpu_kit.py summary --work DIR --mode gpu|dry [--out summary.md]
    python scripts/gpu_kit.py insert summary.md docs/gpu-results.md
    python scripts/gpu_kit.py imports --recorded DIR [--write]

`kit` checks that the folder holds exactly one wheel of every pin in scripts/gpu_wheels.txt and
stays under the travel limit, installs the wheels with pip (offline, no dependencies) into
--target, and imports every module the stages import (scripts/gpu_stage_imports.txt, recorded
from the stages themselves by `imports`). `--cross` installs for the GPU machine's CPython
3.12 / x86-64 instead of this interpreter (the CPU dry run), and skips the import check of the
installed wheels (this interpreter's own packages are checked instead)."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "scripts" / "gpu_wheels.txt"
LIMIT_BYTES = 64 * 2**20  # what may travel with the working tree to the GPU machine
# Per stage, the installed top-level modules its processes import (recorded by a dry run with
# GPU_CHECKS_RECORD_IMPORTS; `imports --write` updates it); the kit check imports all of them.
STAGE_IMPORTS = ROOT / "scripts" / "gpu_stage_imports.txt"
OPTIONAL_IMPORTS = {"colorama"}  # imported only when installed (werkzeug's log handler)
# For CPython 3.12; pip 23 checks Requires-Python against this interpreter anyway (mcore 0.17+).
CROSS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
         "--ignore-requires-python",
         *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64",
                       "manylinux_2_17_x86_64", "manylinux2014_x86_64")
           for a in ("--platform", p)]]
MARKER = "<!-- runs: newest first -->"
# Stages whose script writes its own summary cell (`summary_line` of its --json report).
SCRIPT_STAGES = {"memory": "gpu_memory_check", "colocated": "gpu_colocated_check",
                 "fp8": "gpu_fp8_check", "speculative": "gpu_speculative_check"}
STAGE_TITLES = {"wheels": "wheels (offline install)", "selfcheck": "tools/gpu_selfcheck.py",
                "learner": "scripts/gpu_learner_check.py", "demo": "tiny demo",
                "bench_learner": "bench/learner_step.py",
                "bench_logprobs": "bench/token_logprobs.py",
                **{k: f"scripts/{v}.py" for k, v in SCRIPT_STAGES.items()}}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def read_manifest(path: Path = MANIFEST) -> dict[str, str]:
    """Pins of the manifest: {normalised project name: version}."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version:
            raise SystemExit(f"{path}: '{line}' is not an exact pin NAME==VERSION")
        pins[_norm(name)] = version.strip()
    return pins


def read_stage_imports(path: Path = STAGE_IMPORTS) -> dict[str, list[str]]:
    """{stage: [top-level module, ...]} from lines `stage: mod mod ...` (# comments)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            stage, _, mods = line.partition(":")
            out[stage.strip()] = mods.split()
    return out


def recorded_imports(folder: Path) -> dict[str, list[str]]:
    """{stage: sorted modules} from the files of a GPU_CHECKS_RECORD_IMPORTS run, keeping the
    modules of the distributions the GPU machine has or the kit carries (not the standard
    library, not this repository; not the requirements that only this interpreter's versions
    of the machine's packages bring, such as a newer huggingface-hub's httpx2)."""
    from gpu_machine_venv import KIT, MACHINE, names_of, norm

    keep = names_of(MACHINE) | names_of(KIT)
    dists = importlib.metadata.packages_distributions()
    own = {p.name for p in ROOT.iterdir()} | {"sitecustomize"}
    out: dict[str, set[str]] = {}
    for f in sorted(folder.glob("*.txt")):
        stage = f.name.split(".", 1)[0]
        if stage == "wheels":  # its import check imports the other stages' modules
            continue
        names = {m for m in f.read_text().split() if m not in own | OPTIONAL_IMPORTS
                 and m not in sys.stdlib_module_names
                 and {norm(d) for d in dists.get(m, [])} & keep}
        out.setdefault(stage, set()).update(names)
    return {k: sorted(v) for k, v in sorted(out.items())}


def render_stage_imports(stages: dict[str, list[str]]) -> str:
    head = ("# Installed top-level modules each stage of scripts/gpu_checks.sh imports, as a\n"
            "# CPU dry run in the GPU machine's package set recorded them\n"
            "# (GPU_CHECKS_RECORD_IMPORTS; made by `scripts/gpu_kit.py imports --recorded DIR\n"
            "# --write`). The wheels stage imports every one of them.\n")
    return head + "".join(f"{k}: {' '.join(v)}\n" for k, v in stages.items())


def cmd_imports(args) -> int:
    got = recorded_imports(Path(args.recorded))
    if not got:
        print(f"no recorded imports in {args.recorded}")
        return 1
    text = render_stage_imports(got)
    if args.write:
        STAGE_IMPORTS.write_text(text)
        print(f"wrote {STAGE_IMPORTS}")
    print(text, end="")
    return 0


def check_kit(kit: Path, pins: dict[str, str], limit: int = LIMIT_BYTES) -> tuple[list, list]:
    """Wheels of the kit folder against the pins.

    Returns:
        (the wheels, problems): each problem is one line; none means the kit is usable.
    """
    if not kit.is_dir():
        return [], [f"kit folder {kit} does not exist: run scripts/gpu_wheels.sh"]
    wheels = sorted(kit.glob("*.whl"))
    problems = []
    found: dict[str, list[str]] = {}
    for w in wheels:
        parts = w.name.split("-")
        found.setdefault(_norm(parts[0]), []).append(parts[1] if len(parts) > 1 else "?")
    for name, version in pins.items():
        got = found.get(name, [])
        if not got:
            problems.append(f"no wheel of {name}=={version} in {kit}")
        elif len(got) > 1:
            problems.append(f"{len(got)} wheels of {name} ({', '.join(got)}): keep one")
        elif got[0] != version:
            problems.append(f"{name}: wheel {got[0]}, pinned {version}")
    for name in sorted(set(found) - set(pins)):
        problems.append(f"{name}: wheel not in scripts/gpu_wheels.txt")
    total = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())
    if total > limit:
        problems.append(f"kit is {total / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB limit")
    return wheels, problems


def cmd_kit(args) -> int:
    kit, target = Path(args.kit), Path(args.target)
    wheels, problems = check_kit(kit, read_manifest())
    total = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file()) if kit.is_dir() else 0
    ref = kit / "learner_ref" / "ref.pt"
    report = {"kit": str(kit), "wheels": [w.name for w in wheels], "total_bytes": total,
              "reference": ref.is_file(), "problems": problems, "modules": {}}
    print(f"kit {kit}: {len(wheels)} wheel(s), {total / 2**20:.1f} MiB; learner reference "
          f"{'present' if ref.is_file() else 'absent'}")
    for p in problems:
        print(f"  problem: {p}")
    ok = not problems
    if ok and wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--upgrade",
               "--target", str(target), *(CROSS if args.cross else []), *map(str, wheels)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(f"pip install --target {target}: exit {r.returncode}")
        if r.returncode != 0:
            print(r.stdout[-2000:] + r.stderr[-2000:])
            report["problems"].append(f"pip install failed (exit {r.returncode})")
            ok = False
    if ok:
        # The packages the stages import, as the stages will see them.
        paths = ([] if args.cross else [str(target)]) + [str(ROOT)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        by_stage = read_stage_imports()
        # setuptools first: its distutils shim refuses to load after the stdlib's distutils,
        # which another of the modules may import (in the stages setuptools came earlier)
        needed = sorted({m for mods in by_stage.values() for m in mods},
                        key=lambda m: (m != "setuptools", m))
        code = ("import importlib, json, sys\nout = {}\n"
                f"for m in {needed!r}:\n"
                "    try:\n        mod = importlib.import_module(m)\n"
                "        out[m] = str(getattr(mod, '__version__', 'ok'))\n"
                "    except Exception as e:\n"
                "        out[m] = 'MISSING: ' + type(e).__name__ + ': ' + str(e)[:120]\n"
                "print(json.dumps(out))\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        try:
            mods = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            mods = {"import check": f"FAILED: {r.stderr[-300:]}"}
        report["modules"] = mods
        missing = {m: v for m, v in mods.items() if v.startswith(("MISSING", "FAILED"))}
        print("modules: " + ", ".join(f"{m} {v}" for m, v in mods.items() if m not in missing))
        for m, v in missing.items():
            users = ", ".join(k for k, mods in by_stage.items() if m in mods)
            print(f"  problem: {m} (imported by {users}): {v}")
            report["problems"].append(f"{m} (imported by {users}): {v}")
        ok = not missing
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


# ----------------------------------------------------------------------------- summary


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_stages(work: Path) -> list[dict]:
    """stages.tsv rows written by gpu_checks.sh: name, exit code, seconds, limit."""
    rows = []
    path = work / "stages.tsv"
    if path.is_file():
        for line in path.read_text().splitlines():
            name, rc, secs, limit = line.split("\t")
            rows.append({"name": name, "rc": int(rc), "seconds": float(secs),
                         "limit": int(limit)})
    return rows


def status_of(rc: int, limit: int) -> str:
    """ok / TIMEOUT / FAILED from an exit code under `timeout`."""
    if rc == 0:
        return "ok"
    if rc in (124, 137):
        return f"TIMEOUT (limit {limit} s)"
    return f"FAILED (exit {rc})"


def _fmt(x, spec=".3g"):
    return "n/a" if x is None else format(x, spec)


def stage_numbers(name: str, work: Path) -> str:
    """The one-line result of a stage, read from the files it wrote under `work`."""
    if name == "wheels":
        k = _load_json(work / "kit.json")
        if not k:
            return "no report"
        text = f"{', '.join(k['wheels']) or 'no wheels'} ({k['total_bytes'] / 2**20:.1f} MiB)"
        return text + ("; " + "; ".join(k["problems"]) if k["problems"] else "")
    if name == "selfcheck":
        s = _load_json(work / "selfcheck.json")
        if not s:
            return "no report"
        rows = s["rows"]
        n_ok = sum(r["status"] == "ok" for r in rows)
        bad = [f"{r['check']}: {r['detail']}" for r in rows if r["status"] == "FAIL"]
        skipped = [r["check"] for r in rows if r["status"].startswith("skipped")]
        nccl = [r["detail"] for r in rows
                if r["check"] == "nccl all-reduce" and r["status"] == "ok"]
        parts = [f"{n_ok} ok, {len(bad)} failed, {len(skipped)} skipped"]
        parts += [f"NCCL: {nccl[0]}"] if nccl else []
        parts += [f"FAIL {b}" for b in bad]
        return "; ".join(parts)
    if name == "learner":
        s = _load_json(work / "learner.json")
        if not s:
            return "no report"
        parts = [f"{k}: {v['status']}" for k, v in s["stages"].items()]
        if s["failures"]:
            parts.append(f"{len(s['failures'])} failure(s), first: "
                         f"{s['failures'][0].splitlines()[0][:160]}")
        return "; ".join(parts)
    if name == "demo":
        rows = []
        path = work / "demo" / "metrics.jsonl"
        if path.is_file():
            rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        train = [r for r in rows if "reward/mean" in r]
        if not train:
            return "no metrics"
        evals = [(r["step"], k, r[k]) for r in rows for k in r if k.startswith("eval/reward")]
        step_t = statistics.median(r["time/step"] for r in train if "time/step" in r) \
            if any("time/step" in r for r in train) else None
        text = (f"{len(train)} steps, reward/mean {train[0]['reward/mean']:.3f} -> "
                f"{train[-1]['reward/mean']:.3f}, median step {_fmt(step_t, '.2f')} s")
        if evals:
            step, key, value = evals[-1]
            text += f", {key} {value:.3f} at step {step}"
        return text
    if name == "bench_learner":
        s = _load_json(work / "bench_learner.json")
        if not s or not s["rows"]:
            return "no report"
        r = s["rows"][0]
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        text = (f"{r['model']} {s['dtype']} {s['spec']} spec, {r['params']:,} params, "
                f"{r['tokens']} tokens/step ({s['samples']} x {s['prompt']}+{s['response']}), "
                f"{r['tok_s']:,.0f} tok/s, step {r['step']:.3f} s, MFU {mfu} "
                f"(6 x params x tokens / step time / {_fmt(r['peak_tflops'], '.0f')} TFLOP/s), "
                f"peak memory {_fmt(r['peak_mem_gib'], '.1f')} GiB")
        if s.get("matmul_tflops"):
            text += f"; measured 8192^3 bf16 matmul {s['matmul_tflops']:.0f} TFLOP/s"
        return text
    if name in SCRIPT_STAGES:
        s = _load_json(work / f"{name}.json")
        spec = importlib.util.spec_from_file_location(
            SCRIPT_STAGES[name], ROOT / "scripts" / f"{SCRIPT_STAGES[name]}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # stdlib imports only at module level
        return mod.summary_line(s) if s else "no report"
    if name == "bench_logprobs":
        s = _load_json(work / "bench_logprobs.json")
        if not s or not s["rows"]:
            return "no report"
        return "; ".join(f"{r['tokens']}x{r['vocab']} {r['dtype']}: memory ratio "
                         f"{r['ratio_memory']:.3f}, time ratio {r['ratio_time']:.2f}" + (
                             f", learner fwd+bwd {r['learner_ratio_memory']:.3f} / "
                             f"{r['learner_ratio_time']:.2f}" if "learner_ratio_time" in r
                             else "") for r in s["rows"])
    return ""


def environment() -> dict[str, str]:
    """Device and package versions as this interpreter sees them."""
    env = {"python": sys.version.split()[0]}
    try:
        import torch

        env["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
            env["device"] = (f"{torch.cuda.device_count()} x {p.name}, "
                             f"{p.total_memory / 2**30:.0f} GiB, sm {cap}")
        else:
            env["device"] = "no CUDA device"
    except Exception as e:  # noqa: BLE001 - the summary must be written regardless
        env["torch"] = f"not importable ({type(e).__name__})"
        env["device"] = "unknown"
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        if drv:
            env["driver"] = drv[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    for dist in ("triton", "transformers", "megatron-core", "transformer-engine", "apex", "sglang"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = "absent"
    return env


def render_summary(work: Path, mode: str, when: datetime.datetime | None = None,
                   env: dict[str, str] | None = None, commit: str = "") -> str:
    """The markdown summary of one run of gpu_checks.sh (docs/gpu-results.md format)."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    env = env if env is not None else environment()
    stages = read_stages(work)
    title = "GPU run" if mode == "gpu" else "CPU dry run (plumbing only, not a GPU result)"
    lines = [f"### {when:%Y-%m-%d %H:%M} UTC: {title}", ""]
    lines.append(f"- device: {env.get('device', 'unknown')}"
                 + (f", driver {env['driver']}" if env.get("driver") else ""))
    lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in env.items()
                                            if k not in ("device", "driver")))
    if commit:
        lines.append(f"- commit: {commit}")
    total = sum(s["seconds"] for s in stages)
    limits = sum(s["limit"] for s in stages)
    lines.append(f"- time: {total:.0f} s of the {limits} s the stages were allowed")
    lines += ["", "| stage | result | time | numbers |", "| --- | --- | --- | --- |"]
    for s in stages:
        numbers = stage_numbers(s["name"], work).replace("|", "/")
        lines.append(f"| {STAGE_TITLES.get(s['name'], s['name'])} | "
                     f"{status_of(s['rc'], s['limit'])} | {s['seconds']:.0f} s | {numbers} |")
    failed = [s["name"] for s in stages if s["rc"] != 0]
    lines.append("")
    lines.append(f"Failed: {', '.join(failed)} (logs in checks.log)." if failed
                 else "Every stage passed.")
    if mode == "gpu" and env.get("device") == "no CUDA device":
        lines.append("NO CUDA DEVICE WAS VISIBLE: the stages ran their CPU paths.")
    return "\n".join(lines) + "\n"


def cmd_summary(args) -> int:
    work = Path(args.work)
    text = render_summary(work, args.mode, commit=args.commit or "")
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        stages = read_stages(work)
        Path(args.json).write_text(json.dumps(
            {"mode": args.mode, "stages": [dict(s, status=status_of(s["rc"], s["limit"]),
                                                numbers=stage_numbers(s["name"], work))
                                           for s in stages]}, indent=1))
    print(text, end="")
    return 0


def insert_summary(summary: str, doc: str) -> str:
    """`doc` with `summary` inserted right below the runs marker (newest first)."""
    if MARKER not in doc:
        raise SystemExit(f"the results file has no line '{MARKER}'")
    head, tail = doc.split(MARKER, 1)
    return f"{head}{MARKER}\n\n{summary.strip()}\n{tail}"


def cmd_insert(args) -> int:
    doc = Path(args.doc)
    doc.write_text(insert_summary(Path(args.summary).read_text(), doc.read_text()))
    print(f"inserted {args.summary} into {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kit", help="check the kit folder, install its wheels, import check")
    k.add_argument("--kit", required=True)
    k.add_argument("--target", required=True)
    k.add_argument("--cross", action="store_true",
                   help="install for CPython 3.12 x86-64 (the GPU machine), not this Python")
    k.add_argument("--json", default=None)
    s = sub.add_parser("summary", help="markdown summary of a gpu_checks.sh work directory")
    s.add_argument("--work", required=True)
    s.add_argument("--mode", choices=["gpu", "dry"], required=True)
    s.add_argument("--out", default=None)
    s.add_argument("--json", default=None)
    s.add_argument("--commit", default=None)
    m = sub.add_parser("imports", help="modules per stage from a GPU_CHECKS_RECORD_IMPORTS run")
    m.add_argument("--recorded", required=True)
    m.add_argument("--write", action="store_true", help="update scripts/gpu_stage_imports.txt")
    i = sub.add_parser("insert", help="insert a summary into docs/gpu-results.md")
    i.add_argument("summary")
    i.add_argument("doc")
    args = ap.parse_args(argv)
    return {"kit": cmd_kit, "summary": cmd_summary, "insert": cmd_insert,
            "imports": cmd_imports}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
