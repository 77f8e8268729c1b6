"""The Dockerfile's cuDNN reaches the Transformer Engine binding's compiler (issue 53, defect
8): TE 2.20.2's binding build (build_tools/pytorch.py) reads neither CUDNN_PATH nor CUDNN_HOME,
and its csrc/common.h includes <cudnn.h>. The RUN step that builds it runs here in bash with
stand-ins for python3 (the cuDNN module's path; pip records the environment it got)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# first on PATH (the step runs pip through `env`, which a shell function would not catch)
FAKE_PYTHON = r'''#!/bin/bash
if [[ "$1" == -c ]]; then echo "$FAKE_CUDNN"; exit 0; fi
if [[ " $* " == *" --no-build-isolation "* ]]; then env > "$WORK/binding_env"; fi
'''


def _te_step(work: Path) -> str:
    """The RUN step installing Transformer Engine, its paths moved under `work`."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    runs = re.findall(r"^RUN (.*?)(?=^\S|\Z)", text, re.M | re.S)
    (step,) = [r for r in runs if "transformer-engine-torch" in r]
    step = re.sub(r"--mount=\S+\s*\\\n\s*", "", step).replace("\\\n", " ")
    return re.sub(r"(?<![\w/.-])/(lock|tmp|etc|wheels)\b", lambda m: f"{work}/{m.group(1)}",
                  step)


def _run(tmp_path: Path, with_header: bool) -> subprocess.CompletedProcess:
    work = tmp_path / "work"
    for d in ("lock", "tmp", "etc", "wheels"):
        (work / d).mkdir(parents=True)
    (work / "lock" / "gpu.txt").write_text("megatron-core==0.19.2 --hash=sha256:00\n"
                                           "transformer-engine-torch==2.20.2 --hash=sha256:00\n")
    cudnn = tmp_path / "site" / "nvidia" / "cudnn"
    (cudnn / "include").mkdir(parents=True)
    if with_header:
        (cudnn / "include" / "cudnn.h").write_text("/* cuDNN */\n")
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    script = "TE_CUDA_ARCHS='90;100' MAX_JOBS=4\n" + _te_step(work)
    return subprocess.run(["bash", "-o", "pipefail", "-c", script], capture_output=True,
                          text=True, timeout=60, env={
                              "PATH": f"{fake.parent}:/usr/bin:/bin", "WORK": str(work),
                              "FAKE_CUDNN": str(cudnn), "CPLUS_INCLUDE_PATH": "/opt/inc"})


def test_binding_build_gets_the_cudnn_headers(tmp_path):
    out = _run(tmp_path, with_header=True)
    assert out.returncode == 0, out.stderr
    env = dict(ln.split("=", 1) for ln in
               (tmp_path / "work" / "binding_env").read_text().splitlines() if "=" in ln)
    cudnn = tmp_path / "site" / "nvidia" / "cudnn"
    assert env["CUDNN_PATH"] == env["CUDNN_HOME"] == str(cudnn)
    assert env["CPLUS_INCLUDE_PATH"] == f"{cudnn}/include:/opt/inc"  # what the compiler reads
    assert env["LIBRARY_PATH"] == f"{cudnn}/lib"
    assert env["NVTE_PYTORCH_FORCE_BUILD"] == "TRUE" and env["NVTE_CUDA_ARCHS"] == "90;100"


def test_missing_cudnn_header_is_one_line(tmp_path):
    out = _run(tmp_path, with_header=False)
    assert out.returncode != 0
    assert out.stderr.strip().count("\n") == 0 and "no cudnn.h under" in out.stderr
    assert not (tmp_path / "work" / "binding_env").exists()  # stopped before any pip call
