"""The image's pinned versions (docker/Dockerfile build ARGs) agree with pyproject.toml."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
VERSION_ARGS = ("SGLANG_VERSION", "SGLANG_ROUTER_VERSION", "BASE_TORCH_VERSION", "TE_VERSION",
                "MEGATRON_CORE_VERSION")


def dockerfile_args() -> dict[str, str]:
    """ARG defaults; an ARG declared twice (before and after FROM) must have one default."""
    args: dict[str, str] = {}
    for name, value in re.findall(r"^ARG\s+(\w+)=(\S+)\s*$", DOCKERFILE.read_text(),
                                   re.MULTILINE):
        assert args.setdefault(name, value) == value, f"ARG {name} has two defaults"
    return args


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def requirements(lines: list[str]) -> dict[str, Requirement]:
    return {Requirement(r).name.lower(): Requirement(r) for r in lines}


@pytest.fixture(scope="module")
def args() -> dict[str, str]:
    a = dockerfile_args()
    missing = [n for n in VERSION_ARGS if n not in a]
    assert not missing, f"docker/Dockerfile lacks build ARGs {missing}"
    return a


def test_extras_pins_equal_dockerfile_args(args):
    extras = pyproject()["optional-dependencies"]
    gpu, sgl = requirements(extras["gpu"]), requirements(extras["sglang"])
    te = gpu["transformer-engine"]
    assert str(te.specifier) == f"=={args['TE_VERSION']}", (
        f"pyproject gpu extra pins {te}, Dockerfile TE_VERSION={args['TE_VERSION']}")
    assert {"pytorch", "core_cu13"} <= te.extras  # the binding and the CUDA 13 core wheel
    assert str(sgl["sglang"].specifier) == f"=={args['SGLANG_VERSION']}", (
        f"pyproject sglang extra pins {sgl['sglang']}, "
        f"Dockerfile SGLANG_VERSION={args['SGLANG_VERSION']}")
    assert str(sgl["sglang-router"].specifier) == f"=={args['SGLANG_ROUTER_VERSION']}", (
        f"pyproject sglang extra pins {sgl['sglang-router']}, "
        f"Dockerfile SGLANG_ROUTER_VERSION={args['SGLANG_ROUTER_VERSION']}")


def test_core_dependencies_admit_the_image_versions(args):
    deps = requirements(pyproject()["dependencies"])
    mcore = deps["megatron-core"]
    assert mcore.specifier.contains(args["MEGATRON_CORE_VERSION"]), (
        f"pyproject requires {mcore}, the image installs {args['MEGATRON_CORE_VERSION']}")
    torch = deps["torch"]
    # The image keeps the base image's torch build (SGLang pins it): pyproject must accept it,
    # or `pip install .[sglang]` cannot resolve and the image build stops at step 7.
    assert torch.specifier.contains(args["BASE_TORCH_VERSION"]), (
        f"pyproject requires {torch}, but sglang=={args['SGLANG_VERSION']} and the image use "
        f"torch {args['BASE_TORCH_VERSION']}")


def test_dockerfile_versions_come_from_args(args):
    text = DOCKERFILE.read_text()
    assert args["BASE_IMAGE"] == "lmsysorg/sglang:v${SGLANG_VERSION}"
    body = [ln for ln in text.splitlines() if not ln.lstrip().startswith(("#", "ARG "))]
    for name in VERSION_ARGS:
        assert any(f"${{{name}}}" in ln for ln in body), f"no build step uses ${{{name}}}"
        value = args[name]
        pattern = rf"(?<![\w.]){re.escape(value)}(?![\w.])"
        hard = [ln.strip() for ln in body if re.search(pattern, ln)]
        assert not hard, f"{name}'s value {value} is hard-coded in: {hard}"


def test_te_pin_inside_megatron_cores_te_extra(args):
    """megatron-core's own metadata names the Transformer Engine its `te` extra installs (0.19.2:
    any; its `dev` extra, the set its CI tests, stops below 2.12: docker/README.md says so)."""
    import importlib.metadata

    from packaging.version import Version

    if importlib.metadata.version("megatron-core") != args["MEGATRON_CORE_VERSION"]:
        pytest.skip("the installed megatron-core is not the image's")
    te_reqs = [Requirement(r) for r in importlib.metadata.requires("megatron-core") or []
               if Requirement(r).name == "transformer-engine"]
    install = [r for r in te_reqs if r.marker and r.marker.evaluate({"extra": "te"})]
    assert install, "megatron-core's metadata names no transformer-engine for its te extra"
    for req in install:
        assert req.specifier.contains(Version(args["TE_VERSION"]), prereleases=True), (
            f"TE_VERSION={args['TE_VERSION']} is outside megatron-core's {req.specifier}")
    readme = (ROOT / "docker" / "README.md").read_text()
    for req in te_reqs:
        if not req.specifier.contains(Version(args["TE_VERSION"]), prereleases=True):
            assert str(req.specifier) in readme or "<2.12" in readme, (
                f"docker/README.md does not say TE {args['TE_VERSION']} is outside {req}")


def test_dockerfile_build_steps():
    text = DOCKERFILE.read_text()
    code = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    # BuildKit's built-in frontend: a `syntax` line would pull an image; heredocs need one.
    assert not text.startswith("# syntax") and "<<EOF" not in text
    # Every pip install is offline (the wheelhouse); nothing is fetched from git.
    installs = [ln for ln in code if "pip install" in ln]
    assert len(installs) == 4 and all("--no-index" in ln for ln in installs), installs
    assert "git+https" not in text
    # The TE binding: compiled against the image's torch (no build isolation), with no attempt
    # to download a prebuilt wheel, against the cuDNN torch loads (pip's nvidia-cudnn).
    te_step = text[text.index("CUDNN_PATH="):text.index("transformer-engine-torch==' /lock")]
    assert "nvidia.cudnn" in te_step and "CUDNN_HOME=$CUDNN_PATH" in te_step
    assert "NVTE_PYTORCH_FORCE_BUILD=TRUE" in te_step
    assert "--no-build-isolation" in text[text.index("/tmp/binding.txt"):]
    # Versions compared by release (selfcheck.py), not as strings.
    assert "--only-base sglang==\"${SGLANG_VERSION}\" torch==\"${BASE_TORCH_VERSION}\"" in text
    assert "ran its CI on" not in text
