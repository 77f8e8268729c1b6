"""Write the image lock files: every Python package the images install from the wheelhouse,
pinned by version and sha256 (docker/build.sh gathers them with `pip download --require-hashes`).

    .venv/bin/python docker/lock.py cpu      # the tested .venv (Python 3.11, as the CPU image)
    .venv312/bin/python docker/lock.py gpu   # CPython 3.12 with torch and wheel (sdist metadata)
    python3 docker/lock.py cpu --fetch DIR   # docker/build.sh's step 1: the locked files to DIR

Files are chosen for CPython 3.11 (cpu) / 3.12 (gpu, SGLang's image) on Linux x86_64 with the
same pip options in both modes, so a version with several files resolves to the same one.

cpu: pyproject's dependencies and its `wandb` extra, torch at quickstart.sh's pin (the CPU
wheel), megatron-core at MEGATRON_CORE_CPU, and the build backend (setuptools); versions held at
the running environment's (`pip freeze`, the tested .venv) wherever it has the package.
gpu: only what the GPU image adds to SGLang's image: resolved together with sglang==SGLANG, the
packages of SGLang's own closure are dropped (the base image has them; the build keeps them
fixed). Transformer Engine's core comes as a wheel; its PyTorch binding is an sdist (compiled in
the image against the image's torch), whose requirements are listed here from its PKG-INFO
because resolving an sdist would need torch and CUDA on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK_DIR = ROOT / "docker" / "lock"
MEGATRON_CORE_CPU = "0.16.1"
MEGATRON_CORE_GPU = "0.19.2"
SGLANG = "0.5.23"
SGLANG_ROUTER = "0.3.2"
TE = "2.20.2"
# transformer_engine_torch 2.20.2 PKG-INFO's Requires-Dist, torch left out (the base image's).
TE_TORCH_REQUIRES = ["einops", "onnxscript", "onnx", "packaging", "pydantic", "nvdlfw-inspect",
                     "nvidia-cudnn-frontend>=1.29.0"]
# Build tools of the binding's sdist (its build-system.requires, torch aside; --no-build-isolation).
TE_TORCH_BUILD = ["setuptools>=61.0", "wheel", "pybind11", "ninja"]
INDEX = "https://pypi.org/simple"
SDIST = "transformer-engine-torch"  # the one locked file that is not a wheel
# Locked for the gpu image although SGLang's closure has them: the pinned router, and the build
# backend the project's editable install takes from the wheelhouse (build isolation, offline).
KEEP = ("sglang-router", "setuptools")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64",
             "manylinux1_x86_64", "linux_x86_64"]


def target_flags(flavor: str) -> list[str]:
    """pip's options for the image's interpreter and platform (the lock and the wheelhouse use
    the same ones, so pip picks the same file of a version that has several). gpu: none, pip
    runs under CPython 3.12 on Linux x86_64 itself (with --platform, PyPI's index offers pip
    no sglang after 0.5.10.post1)."""
    if flavor == "gpu":
        assert sys.version_info[:2] == (3, 12) and sys.platform == "linux", (
            "the gpu lock and wheelhouse need CPython 3.12 on Linux (PYTHON=.venv312/bin/python)")
        return ["--only-binary=:all:"]
    pyver = "3.11"
    flags = ["--only-binary=:all:", "--python-version", pyver, "--implementation", "cp"]
    for abi in (f"cp{pyver.replace('.', '')}", "abi3", "none"):
        flags += ["--abi", abi]
    for plat in PLATFORMS:
        flags += ["--platform", plat]
    return flags


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements() -> list[str]:
    """pyproject's dependencies, its wandb extra and its build backend."""
    import tomllib  # Python 3.11+, as both images' Pythons

    with open(ROOT / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)
    proj = data["project"]
    return [*proj["dependencies"], *proj["optional-dependencies"]["wandb"],
            *data["build-system"]["requires"]]


def torch_cpu_pin() -> str:
    """quickstart.sh's torch pin, as the CPU wheel (e.g. torch==2.13.0+cpu)."""
    m = re.search(r'^TORCH_PIN="torch==([^"]+)"', (ROOT / "quickstart.sh").read_text(), re.M)
    assert m, "quickstart.sh has no TORCH_PIN line"
    return f"torch=={m.group(1)}+cpu"


def pinned(reqs: list[str], pins: dict[str, str]) -> list[str]:
    """reqs with the named projects replaced by exact pins."""
    out = [r for r in reqs if canonical(re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0]) not in pins]
    return out + [f"{name}=={version}" for name, version in pins.items()]


def lock_line(name: str, version: str, sha256: str) -> str:
    return f"{canonical(name)}=={version} --hash=sha256:{sha256}"


def lock_cpu(tmp: Path) -> list[str]:
    assert sys.version_info[:2] == (3, 11), "run the cpu lock with .venv's Python (3.11)"
    torch = torch_cpu_pin()
    reqs = pinned(project_requirements(), {"torch": torch.split("==")[1],
                                           "megatron-core": MEGATRON_CORE_CPU})
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                            check=True, capture_output=True, text=True).stdout.splitlines()
    held = [ln for ln in freeze if "==" in ln and not ln.startswith(("torch==", "megatron"))]
    (tmp / "req.txt").write_text("\n".join(reqs) + "\n")
    (tmp / "held.txt").write_text("\n".join(held) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *target_flags("cpu"),
                    "-d", str(tmp / "w"), "-r", str(tmp / "req.txt"), "-c", str(tmp / "held.txt")],
                   check=True)
    lines = []
    for f in sorted((tmp / "w").iterdir()):
        name, version = f.name.split("-")[:2]
        lines.append(lock_line(name, version, hashlib.sha256(f.read_bytes()).hexdigest()))
    return lines


def resolve(tmp: Path, reqs: list[str], tag: str) -> list[dict]:
    """pip's dry-run resolution for the GPU image's Python against PyPI (the `install` list)."""
    (tmp / f"{tag}.txt").write_text("\n".join(reqs) + "\n")
    report = tmp / f"{tag}.json"
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
    env["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                    "-q", *target_flags("gpu"),
                    "--index-url", INDEX, "--report", str(report),
                    "-r", str(tmp / f"{tag}.txt")], check=True, env=env)
    return json.loads(report.read_text())["install"]


def lock_gpu(tmp: Path) -> list[str]:
    """Needs a Python with torch and wheel (the binding's sdist metadata imports torch)."""
    base = {canonical(i["metadata"]["name"]) for i in resolve(tmp, [f"sglang=={SGLANG}"], "base")}
    reqs = [r for r in project_requirements() if not r.startswith("torch")]
    reqs = pinned(reqs, {"megatron-core": MEGATRON_CORE_GPU, "sglang": SGLANG,
                         "sglang-router": SGLANG_ROUTER, "transformer-engine": TE,
                         "transformer-engine-cu13": TE})
    full = resolve(tmp, reqs + TE_TORCH_REQUIRES + TE_TORCH_BUILD, "full")
    lines = []
    for item in full:
        name = canonical(item["metadata"]["name"])
        if name in base and name not in KEEP:
            continue
        sha = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(lock_line(name, item["metadata"]["version"], sha))
    sdist = tmp / "sdist"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
                    "-q", "--index-url", INDEX, "-d", str(sdist),
                    f"{SDIST}=={TE}"], check=True,
                   env={**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""})
    [f] = list(sdist.iterdir())
    lines.append(lock_line(SDIST, TE, hashlib.sha256(f.read_bytes()).hexdigest()))
    return sorted(lines)


def read_lock(flavor: str) -> dict[str, str]:
    """sha256 -> `name==version` of every line of docker/lock/<flavor>.txt."""
    out = {}
    for line in (LOCK_DIR / f"{flavor}.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req, _, sha = line.partition(" --hash=sha256:")
            out[sha.strip()] = req
    return out


def check_wheelhouse(folder: Path, flavor: str) -> int:
    """Remove files the lock does not name; 1 (naming them) if a locked file is missing."""
    want = read_lock(flavor)
    have = set()
    for f in sorted(folder.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else ""
        if sha in want:
            have.add(sha)
        else:
            print(f"lock.py: {f.name} is not in docker/lock/{flavor}.txt: removed")
            if f.is_file():
                f.unlink()
    missing = sorted(want[s] for s in set(want) - have)
    if missing:
        print(f"lock.py: {folder} lacks {len(missing)} locked files: {', '.join(missing[:5])}",
              file=sys.stderr)
        return 1
    return 0


def fetch(folder: Path, flavor: str) -> int:
    """pip downloads the locked files into `folder` (hash-checked), then check_wheelhouse."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [ln for ln in (LOCK_DIR / f"{flavor}.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    with tempfile.TemporaryDirectory() as tmp:
        wheels, sdists = Path(tmp) / "wheels.txt", Path(tmp) / "sdists.txt"
        wheels.write_text("\n".join(ln for ln in lines if not ln.startswith(SDIST + "==")))
        sdists.write_text("\n".join(ln for ln in lines if ln.startswith(SDIST + "==")))
        pip = ["-m", "pip", "download", "-q", "--no-deps", "--require-hashes", "-d", str(folder)]
        subprocess.run([sys.executable, *pip, *target_flags(flavor), "-r", str(wheels)],
                       check=True)
        if sdists.read_text():
            # Its metadata step imports torch and wheel: SDIST_PYTHON names a Python with both.
            py = os.environ.get("SDIST_PYTHON", sys.executable)
            subprocess.run([py, *pip, "--no-build-isolation", "-r", str(sdists)], check=True)
    return check_wheelhouse(folder, flavor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("flavor", choices=["cpu", "gpu"])
    ap.add_argument("--fetch", type=Path, metavar="DIR",
                    help="download the locked files into DIR instead (docker/build.sh's step 1)")
    args = ap.parse_args()
    if args.fetch:
        sys.exit(fetch(args.fetch, args.flavor))
    with tempfile.TemporaryDirectory() as tmp:
        lines = (lock_cpu if args.flavor == "cpu" else lock_gpu)(Path(tmp))
    head = [f"# {args.flavor} image lock: written by `python docker/lock.py {args.flavor}` "
            "(do not edit by hand).",
            "# docker/build.sh downloads exactly these files (pip --require-hashes) into the "
            "wheelhouse."]
    out = LOCK_DIR / f"{args.flavor}.txt"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(head + lines) + "\n")
    print(f"{out.relative_to(ROOT)}: {len(lines)} packages")


if __name__ == "__main__":
    main()
