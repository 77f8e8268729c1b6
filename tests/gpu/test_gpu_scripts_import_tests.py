"""The GPU kit's scripts import this repository's `tests` folder, a namespace package (no
`__init__.py`): a regular package named `tests` anywhere on sys.path (site-packages, the kit's
`pip --target` folder; some wheels ship one) wins over a namespace package wherever it sits on
the path, and `tests.megatron` then does not import. The scripts and the learner check's
workers bind `tests` to the repository's folder first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def shadow(tmp_path):
    """A folder with a regular `tests` package, as a wheel installed into the kit would leave."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    return str(tmp_path)


def _run(code: str, shadow: str):
    env = dict(os.environ, PYTHONPATH=shadow, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(ROOT / "scripts"))


@pytest.mark.parametrize("script", ["gpu_learner_check", "gpu_memory_check"])
def test_scripts_import_the_repository_tests_beside_a_shadowing_package(shadow, script):
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import {script}; "
            "import tests.megatron._dist as d; print(d.__file__)")
    r = _run(code, shadow)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(ROOT / "tests" / "megatron" / "_dist.py")


def test_learner_check_workers_import_the_repository_tests(shadow):
    """A worker of scripts/gpu_learner_check.py, started the way tests/megatron/_dist.py starts
    it (the kit's folder on PYTHONPATH), reaches `tests.megatron._gpu_extra`."""
    code = (f"import runpy, sys; sys.argv = ['_workers.py']; "
            f"runpy.run_path({str(ROOT / 'tests' / 'megatron' / '_workers.py')!r}); "
            "import tests.megatron._gpu_extra as g; print(g.__file__)")
    r = _run(code, shadow)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(ROOT / "tests" / "megatron" / "_gpu_extra.py")
