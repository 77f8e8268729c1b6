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
                "TE_GIT_REF", "APEX_COMMIT", "MEGATRON_CORE_VERSION")


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
    assert "pytorch" in te.extras
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
    major_minor = ".".join(args["TE_VERSION"].split(".")[:2])
    assert args["TE_GIT_REF"] == f"v{major_minor}", "TE_GIT_REF must be TE_VERSION's release tag"
    assert re.fullmatch(r"[0-9a-f]{40}", args["APEX_COMMIT"]), "APEX_COMMIT must be a full sha"
    body = [ln for ln in text.splitlines() if not ln.lstrip().startswith(("#", "ARG "))]
    for name in VERSION_ARGS:
        assert any(f"${{{name}}}" in ln for ln in body), f"no build step uses ${{{name}}}"
        value = args[name]
        pattern = rf"(?<![\w.]){re.escape(value)}(?![\w.])"
        hard = [ln.strip() for ln in body if re.search(pattern, ln)]
        assert not hard, f"{name}'s value {value} is hard-coded in: {hard}"


def test_te_pin_inside_megatron_cores_tested_range(args):
    """megatron-core's own metadata names the Transformer Engine range it is tested with."""
    import importlib.metadata

    from packaging.version import Version

    if importlib.metadata.version("megatron-core") != args["MEGATRON_CORE_VERSION"]:
        pytest.skip("the installed megatron-core is not the image's")
    te_reqs = [Requirement(r) for r in importlib.metadata.requires("megatron-core") or []
               if Requirement(r).name == "transformer-engine"]
    assert te_reqs, "megatron-core's metadata names no transformer-engine range"
    for req in te_reqs:  # e.g. transformer-engine[...]<2.12.0,>=2.9.0a0; extra == "dev"
        assert req.specifier.contains(Version(args["TE_VERSION"]), prereleases=True), (
            f"TE_VERSION={args['TE_VERSION']} is outside megatron-core's {req.specifier}")


def test_dockerfile_build_steps():
    text = DOCKERFILE.read_text()
    # TE's CMake build needs cmake >= 3.21 among the build tools.
    assert re.search(r'pip install [^\n]*"cmake>=3\.21"', text)
    # cuDNN of the pip package for the TE build (CUDNN_PATH and CUDNN_HOME set before it).
    te_step = text[text.index("CUDNN_PATH="):text.index("TransformerEngine.git@")]
    assert "nvidia.cudnn" in te_step and "CUDNN_HOME=$CUDNN_PATH" in te_step
    # Versions compared by release number, not as strings.
    assert 'assert sglang == "${SGLANG_VERSION}"' not in text
    assert text.count("Version(") >= 4 and ".release" in text
    # No claim that another project ran CI on this exact version set.
    assert "ran its CI on" not in text
