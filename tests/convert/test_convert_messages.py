"""Conversion errors in one line, before anything starts (issue 43 items 13, 17, 19).

- The (--tp, --pp, --ep) layout is checked against the model before any process starts, in
  the convert flags' names (not the train fields').
- A full disk (a tiny tmpfs mounted for the test; root only) is one line naming the output
  and its mount point: hf-to-mcore (Megatron's checkpoint workers), mcore-to-hf (safetensors),
  a run checkpoint save (`Checkpointer.save`); nothing is left behind.
- No FutureWarning on a checkpoint load; the usage line of tools/convert_checkpoint.py names
  the script; the `--help` learner.py points at prints a usage.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from convert_checkpoint import main  # noqa: E402

from tests.convert.tiny_models import make_tiny_model  # noqa: E402

ARCH = "Qwen3ForCausalLM"


def _cli(*argv, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), *argv,
                           "--no-progress"], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("flags,named", [(["--pp", "64"], "--pp"), (["--pp", "8"], "--pp"),
                                         (["--tp", "2"], "--tp")])
def test_layout_is_checked_before_any_process_starts(tmp_path, capsys, monkeypatch, flags,
                                                     named):
    from megatron_gspo.megatron.io import conversion as conv

    hf = tmp_path / "kv1"
    make_tiny_model(ARCH, hf, num_key_value_heads=1)  # 4 layers, one KV head
    capsys.readouterr()

    def no_launch(*a, **k):
        raise AssertionError("a conversion process was started")

    monkeypatch.setattr(conv, "launch", no_launch)
    t0 = time.perf_counter()
    rc = main(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o"), *flags,
               "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert named in err and "parallel." not in err and "megatron_gspo." not in err, err
    assert time.perf_counter() - t0 < 20 and not (tmp_path / "o").exists()


@pytest.fixture
def tiny_fs(tmp_path):
    """A 120 KiB tmpfs (smaller than the tiny model's weights); skipped unless mountable."""
    d = tmp_path / "tiny_fs"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=120k", "tmpfs",
                                            str(d)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)  # lazy: a file may be open


def _one_line_disk_full(p, where: Path):
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("convert_checkpoint:")]
    assert p.returncode == 1 and len(lines) == 1, p.stderr[-3000:]
    # ENOSPC reads "no space left"; where torch.save's zip writer hits the full disk it only
    # reports a short write ("unexpected pos N vs M"), which reads "full disk or quota?"
    # (runtime/diskfull.py); which of the two a run meets depends on where the writes stop
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "no space left" in lines[0] or "(full disk or quota?)" in lines[0], lines[0]
    assert f"mounted at {where}" in lines[0], lines[0]


@pytest.mark.slow
def test_a_full_disk_is_one_line(tiny_hf, tiny_fs, tmp_path):
    p = _cli("hf-to-mcore", "--hf", str(tiny_hf[ARCH]), "--out", str(tiny_fs / "mc"))
    _one_line_disk_full(p, tiny_fs)
    assert not list(tiny_fs.iterdir())  # no partial output, no temp dir
    ck = tmp_path / "mc"
    assert _cli("hf-to-mcore", "--hf", str(tiny_hf[ARCH]), "--out", str(ck)).returncode == 0
    p = _cli("mcore-to-hf", "--ckpt", str(ck), "--out", str(tiny_fs / "hf"))
    _one_line_disk_full(p, tiny_fs)
    assert not list(tiny_fs.iterdir())
    assert "FutureWarning" not in p.stderr, p.stderr[-3000:]  # the load warns nothing
    p = _cli("mcore-to-hf", "--ckpt", str(ck), "--out", str(tmp_path / "hf"))
    assert p.returncode == 0 and "Warning" not in p.stderr, p.stderr[-3000:]


def test_a_full_disk_during_a_checkpoint_save_is_one_line(tiny_fs):
    from megatron_gspo.runtime.run_checkpoint import CheckpointError, Checkpointer

    class BigLearner:
        chunks = [torch.nn.Linear(1, 1)]

        def save_checkpoint(self, path):
            os.makedirs(path, exist_ok=True)
            torch.save({"w": torch.zeros(1 << 16)}, os.path.join(path, "w.pt"))  # 256 KiB

    ck = Checkpointer(tiny_fs / "checkpoints")
    with pytest.raises(CheckpointError) as e:
        ck.save(3, BigLearner(), {"step": 3})
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "step 3 not written" in msg, msg
    assert f"mounted at {tiny_fs}" in msg, msg
    assert not list((tiny_fs / "checkpoints").iterdir())  # the partial save is gone


def test_usage_names_the_script_and_help_pointers_print_help():
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "--help"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.startswith("usage: convert_checkpoint.py"), p.stdout
    doc = (ROOT / "megatron_gspo" / "megatron" / "learner.py").read_text()
    cmd = re.search(r"`python -m ([\w.]+) --help`", doc)
    assert cmd, "learner.py names no --help"
    p = subprocess.run([sys.executable, "-m", cmd.group(1), "--help"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.startswith("usage:"), (p.stdout, p.stderr[-2000:])
