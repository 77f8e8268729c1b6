"""What can be checked of the image build without docker: the lock files cover the project's
requirements at the pins the Dockerfile and quickstart.sh name, docker/build.sh, the Dockerfile,
its build-context allowlist and .gitignore agree, the tier script passes shellcheck, and the
image's self-check and run summary decide right on this machine's install and on made-up runs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docker"))

import run_summary  # noqa: E402
import selfcheck  # noqa: E402
from test_docker_pins import dockerfile_args, pyproject  # noqa: E402

DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
LINE = re.compile(r"^([a-z0-9][a-z0-9-]*)==(\S+) --hash=sha256:([0-9a-f]{64})$")


def lock(flavor: str) -> dict[str, str]:
    """name -> version of docker/lock/<flavor>.txt; every line must be name==version --hash."""
    out = {}
    for ln in (ROOT / "docker" / "lock" / f"{flavor}.txt").read_text().splitlines():
        if ln.startswith("#") or not ln.strip():
            continue
        m = LINE.match(ln)
        assert m, f"docker/lock/{flavor}.txt: bad line {ln!r}"
        assert m.group(1) not in out, f"docker/lock/{flavor}.txt names {m.group(1)} twice"
        out[m.group(1)] = m.group(2)
    return out


def project_requirements() -> list[Requirement]:
    proj = pyproject()
    return [Requirement(r) for r in proj["dependencies"] + proj["optional-dependencies"]["wandb"]]


def test_cpu_lock_covers_the_project_at_the_tested_pins():
    locked = lock("cpu")
    for req in project_requirements():
        name = canonicalize_name(req.name)
        assert name in locked, f"docker/lock/cpu.txt lacks {req}"
        assert req.specifier.contains(Version(locked[name]), prereleases=True), (
            f"docker/lock/cpu.txt has {name}=={locked[name]}, pyproject wants {req}")
    pin = re.search(r'^TORCH_PIN="torch==(.+)"', (ROOT / "quickstart.sh").read_text(), re.M)
    assert locked["torch"] == f"{pin.group(1)}+cpu", "the CPU image's torch is quickstart's pin"
    assert locked["megatron-core"] == "0.16.1"  # Python 3.11: 0.17+ need 3.12
    assert "setuptools" in locked  # the build backend, for the editable install offline


def test_gpu_lock_holds_the_dockerfile_versions():
    locked, args = lock("gpu"), dockerfile_args()
    assert locked["megatron-core"] == args["MEGATRON_CORE_VERSION"]
    assert locked["sglang-router"] == args["SGLANG_ROUTER_VERSION"]
    for name in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch"):
        assert locked[name] == args["TE_VERSION"], f"{name} locked at {locked.get(name)}"
    # Neither SGLang nor torch: they are the base image's, kept fixed by its constraints.
    assert not {"sglang", "torch", "sglang-kernel", "flashinfer-python"} & set(locked)
    assert "setuptools" in locked  # the editable install's build backend, offline


def test_gpu_lock_and_sglang_cover_the_project():
    """A requirement the GPU lock leaves out must come with SGLang 0.5.23 (its closure as the
    sglang_real tier installs it, scripts/sglang_cpu/lock-0.5.23.txt)."""
    locked = lock("gpu")
    args = dockerfile_args()
    base_lock = ROOT / "scripts" / "sglang_cpu" / f"lock-{args['SGLANG_VERSION']}.txt"
    base = {canonicalize_name(ln.split("==")[0]) for ln in base_lock.read_text().splitlines()
            if "==" in ln and not ln.startswith("#")}
    missing = [str(r) for r in project_requirements()
               if canonicalize_name(r.name) not in set(locked) | base]
    assert missing == [], f"neither docker/lock/gpu.txt nor SGLang's closure has {missing}"


def test_build_script_and_dockerfile_agree():
    build = (ROOT / "docker" / "build.sh").read_text()
    stages = set(re.findall(r"^FROM \S+ AS deps-(\w+)$", DOCKERFILE, re.M))
    assert stages == {"cpu", "gpu"} and "FROM deps-${FLAVOR} AS image" in DOCKERFILE
    assert re.search(r'"\$flavor" == cpu \|\| "\$flavor" == gpu', build)
    assert "--build-arg \"FLAVOR=$flavor\"" in build and "--network host" in build
    assert "docker/lock.py \"$flavor\" --fetch \"$wheels\"" in build
    assert "wheels=.docker-wheelhouse/$flavor" in build
    # The Dockerfile reads the wheelhouse and the lock files through mounts, never COPY.
    assert DOCKERFILE.count("source=.docker-wheelhouse") == 3
    assert DOCKERFILE.count("source=docker/lock,target=/lock") == 2
    assert "/lock/cpu.txt" in DOCKERFILE and "/lock/gpu.txt" in DOCKERFILE


def test_build_context_allowlist_covers_the_copies():
    allowed = {ln[1:] for ln in (ROOT / "docker" / "Dockerfile.dockerignore").read_text()
               .splitlines() if ln.startswith("!")}
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore, "the build context is an allowlist"
    copies = [src for ln in re.findall(r"^COPY (.+)$", DOCKERFILE, re.M)
              for src in ln.split()[:-1]]
    assert copies and sorted(set(copies) - allowed) == []
    assert ".docker-wheelhouse" in allowed
    for needed in ("docker/selfcheck.py", "docker/run_summary.py", "tools/gpu_selfcheck.py",
                   "examples/tiny/config.yaml", "docker/launch/colocated.sh"):
        assert needed.split("/")[0] in copies and (ROOT / needed).exists(), needed
    gitignore = (ROOT / ".gitignore").read_text().splitlines()
    assert "/.docker-wheelhouse/" in gitignore and "/.docker-tier/" in gitignore


def test_tier_and_build_scripts_pass_shellcheck():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck binary not installed (apt-get install -y shellcheck)")
    scripts = [ROOT / "scripts" / "docker_tier.sh", ROOT / "docker" / "build.sh"]
    r = subprocess.run([exe, "-x", *map(str, scripts)], capture_output=True, text=True,
                       cwd=ROOT, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_selfcheck_pins_decide_on_this_install():
    import importlib.metadata

    torch = importlib.metadata.version("torch")
    rows = selfcheck.check_pins([f"torch=={Version(torch).public}", "torch==0.0.1",
                                 "no-such-package-xyz==1.0", "# a comment"])
    assert [(r[0], r[1]) for r in rows] == [("pin torch", True), ("pin torch", False),
                                            ("pin no-such-package-xyz", False)]
    assert "pinned 0.0.1" in rows[1][2] and "not installed" in rows[2][2]
    assert selfcheck.public("2.13.0+cpu") == "2.13.0"
    assert selfcheck.main(["--only-base", f"torch=={torch}"]) == 0
    assert selfcheck.main(["--only-base", "torch==0.0.1"]) == 1


def test_selfcheck_pip_check_fails_only_on_new_problems():
    base = {"vllm 0.1 requires torch==2.0, which is not installed."}
    assert selfcheck.pip_check_row(0, "No broken requirements found.\n", set())[1]
    ok, detail = selfcheck.pip_check_row(1, next(iter(base)) + "\n", base)[1:]
    assert ok and "inherited" in detail
    new = "megatron-core 0.19.2 has requirement packaging>=24.2, but you have packaging 23.0."
    ok, detail = selfcheck.pip_check_row(1, f"{next(iter(base))}\n{new}\n", base)[1:]
    assert not ok and detail == new


def test_selfcheck_outside_the_image_says_so(tmp_path, capsys):
    assert selfcheck.main(["--pins", str(tmp_path / "none.txt")]) == 1
    assert "no pins file" in capsys.readouterr().err


def _run_dir(tmp_path: Path, steps: int, ckpt: int, world: int, events: str) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints" / f"step_{ckpt:08d}").mkdir(parents=True)
    (run / "checkpoints" / f"step_{ckpt:08d}" / "COMPLETE").write_text(
        json.dumps({"step": ckpt, "world_size": world, "files": {}}))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 0.1, "reward/mean": 0.5}) + "\n" for s in range(steps)))
    (run / "events.log").write_text(events)
    return run


def test_run_summary_passes_a_resumed_run(tmp_path):
    run = _run_dir(tmp_path, 6, 6, 2, "[t] run dir /r; resumed from /r/checkpoints/step_00000004"
                   " at step 4\n")
    assert run_summary.check(run, 6, 2, 6, 4) == []


def test_run_summary_names_what_is_wrong(tmp_path):
    run = _run_dir(tmp_path, 5, 4, 1, "[t] run dir /r; starting from the initial weights\n")
    problems = run_summary.check(run, 6, 2, 6, 4)
    assert len(problems) == 4, problems
    assert any("expected 0..5" in p for p in problems)
    assert any("step 4, expected 6" in p for p in problems)
    assert any("1 ranks, not 2" in p for p in problems)
    assert any("resumed at step 4" in p for p in problems)
