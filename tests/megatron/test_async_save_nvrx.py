"""Asynchronous checkpoints beside every nvidia-resiliency-ext (NVRx) release the registry serves
(issue 53, defect 3), in both tiers (megatron-core 0.16.1 in .venv, 0.19.2 in .venv312).

Each release is installed (`pip install --no-deps --target`) into a scratch folder put on the
PYTHONPATH of a worker process (tests/megatron/_nvrx_worker.py) that makes a real asynchronous
save of a tiny learner through Checkpointer + AsyncSaves, waits, closes and loads it back, and
closes an AsyncSaves holding the release's own `AsyncCallsQueue`. What megatron-core decides is
asked of megatron-core (strategies/torch.py `HAVE_NVRX`); none of these releases reaches the
0.6.0 it needs, so the built-in writer is used. From 0.17 megatron.core cannot even be imported
beside NVRx 0.4.0/0.4.1 (its import-time check reads `nvidia_resiliency_ext.__version__`, which
those releases lack): that is one ImportError line naming the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from megatron_gspo.megatron import compat

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_nvrx_worker.py")
RELEASES = ("0.1.3", "0.2.0", "0.2.1", "0.3.0", "0.4.0", "0.4.1")  # the registry's, all of them


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600)


def test_the_registry_serves_the_releases_tested():
    out = _pip("index", "versions", "nvidia-resiliency-ext")
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("Available versions:"))
    served = sorted((v.strip() for v in line.split(":", 1)[1].split(",")), key=Version)
    assert served == sorted(RELEASES, key=Version), f"add the new releases to RELEASES: {served}"


@pytest.fixture(scope="module")
def nvrx_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("nvrx")


def _install(release: str, root: Path) -> Path:
    target = root / release
    out = _pip("install", "--quiet", "--no-deps", "--no-compile", "--target", str(target),
               f"nvidia-resiliency-ext=={release}")
    assert out.returncode == 0, out.stderr[-2000:]
    return target


# The default tier checks the newest release; every release runs in the slow tier and in the
# mcore_new tier (tests/conftest.py), which selects by file, not by the slow mark.
@pytest.mark.parametrize("release", [r if r == RELEASES[-1] else pytest.param(
    r, marks=pytest.mark.slow) for r in RELEASES])
def test_async_save_and_close_beside_nvrx(release, tmp_path, nvrx_root):
    target = _install(release, nvrx_root)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(WORKER), str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    report_file = tmp_path / "report.json"
    assert report_file.is_file(), f"worker exit {out.returncode}:\n{out.stderr[-3000:]}"
    report = json.loads(report_file.read_text())
    assert "exception" not in report, report["exception"]

    refused = compat.version() >= (0, 17, 0) and Version(release) >= Version("0.4.0")
    if refused:  # megatron.core cannot be imported: our one line, not its traceback
        line = report["import_error"]
        assert line.startswith("ImportError: ") and "\n" not in line, line
        assert f"nvidia-resiliency-ext {release}:" in line, line
        assert "pip uninstall nvidia-resiliency-ext" in line and ">=0.6.0" in line, line
    else:
        assert "import_error" not in report, report
        save = report["save"]
        assert (save["step"], save["finalized"], save["verify"], save["reloaded_equal"]) == \
            (1, 1, None, True), save
        if compat.version() < (0, 17, 0):
            assert save["kwargs"] == {}, save
        else:  # asked of megatron-core, which needs NVRx >= 0.6.0
            assert save["mcore_have_nvrx"] is False, save
            assert save["kwargs"] == {"async_strategy": "mcore"}, save
        assert save["queue"].startswith("megatron.core.dist_checkpointing"), save

    close = report["nvrx_close"]
    if Version(release) >= Version("0.2.0"):  # releases with checkpointing.async_ckpt
        assert close == {"queue": "nvrx", "error": None}, close
    else:
        assert close["queue"] is None, close
