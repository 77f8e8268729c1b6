"""A full disk under an asynchronous checkpoint is one line, as under a synchronous one (issue 54,
defect 9): the forked writer's failure comes back at the next finalize and names the checkpoint,
the mount point and the newest complete checkpoint; the partial save is removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs: the small files of a tiny-demo checkpoint fit (about 80 KB), the learner's
    data file (about 10 MB, written by the forked writer) does not. Root only."""
    d = tmp_path / "small_fs"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs",
                                            str(d)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_a_full_disk_under_an_asynchronous_checkpoint_is_one_line(small_fs, tmp_path):
    ck = small_fs / "checkpoints"
    out = subprocess.run(
        [sys.executable, "-m", "megatron_gspo.cli", "train",
         str(ROOT / "examples" / "tiny" / "config.yaml"), "--run-dir", str(tmp_path / "run"),
         "train.max_steps=2", "checkpoint.interval=1", "checkpoint.async_save=true",
         f"checkpoint.dir={ck}", "logging.progress_bar=false"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("megatron-gspo:")]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-4000:]
    line = lines[0]
    assert "checkpoint step 1 not written" in line and f"mounted at {small_fs}" in line, line
    assert "newest complete checkpoint is none" in line, line
    assert not [p for p in ck.iterdir() if p.name.startswith(".tmp_")]  # partial save removed
