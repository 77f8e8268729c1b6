"""One line, not a traceback (issue 54, defect 9): a device-ledger spec that cannot be read
(missing, truncated, an unknown key, a wrong type, a directory), `plan --ledger-spec` to an empty
path, a directory or a full disk, and `fields`, `fields --markdown` and `config` into a full
standard output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.cli import main
from megatron_gspo.runtime import device_ledger

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
GPU = ROOT / "examples" / "qwen3_gpu"
GOOD = {"name": "x", "gpu_bytes": 80 * 10**9, "sizes": {"learner weights": 1},
        "plan_moments": {"training": 1}}


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("spec, says", [
    (None, "No such file or directory"),
    ('{"name": "x", "gpu_by', "not a spec"),
    ({**GOOD, "gpu_mem": 1}, "unknown key 'gpu_mem'"),
    ({**GOOD, "gpu_bytes": "80GB"}, "gpu_bytes: '80GB' is not int"),
    ({**GOOD, "sizes": {"learner weights": -1}}, "sizes:"),
    ({k: v for k, v in GOOD.items() if k != "sizes"}, "missing key 'sizes'"),
    ("DIR", "Is a directory"),
])
def test_a_ledger_spec_that_cannot_be_read_is_one_line(spec, says, tmp_path, monkeypatch,
                                                       capsys):
    path = tmp_path / "spec.json"
    if spec == "DIR":
        path.mkdir()
    elif isinstance(spec, str):
        path.write_text(spec)
    elif spec is not None:
        path.write_text(json.dumps(spec))
    monkeypatch.setenv(device_ledger.ENV, str(path))
    monkeypatch.setattr(device_ledger, "_ACTIVE", None)
    rc = main(["train", str(TINY), "--run-dir", str(tmp_path / "run"), "train.max_steps=1",
               "logging.progress_bar=false"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and f"{device_ledger.ENV}: ledger spec {path}" in line and says in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step


@pytest.mark.parametrize("target, says", [("", "is empty"), ("DIR", "is a directory"),
                                          ("/dev/full", "No space left on device")])
def test_plan_ledger_spec_to_a_bad_place_is_one_line(target, says, tmp_path, capsys):
    target = str(tmp_path) if target == "DIR" else target
    rc = main(["plan", str(GPU / "qwen3_8b_1node.yaml"), "--model-config",
               str(GPU / "shapes" / "Qwen3-8B"), "--brief", "--ledger-spec", target])
    assert rc == 2 and says in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("args", [["fields"], ["fields", "--markdown"], ["config", str(TINY)]])
def test_a_full_stdout_is_one_line(args):
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", *args], stdout=full,
                             stderr=subprocess.PIPE, text=True, timeout=300, cwd=ROOT)
    line = _one_line(out.stderr)
    assert out.returncode == 2 and line == ("megatron-gspo: cannot write to standard output: "
                                            "No space left on device (full disk or quota?)")


def test_a_closed_pipe_is_quiet():
    r, w = os.pipe()
    os.close(r)  # the reader went away (`| head -1`)
    out = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "fields"], stdout=w,
                         stderr=subprocess.PIPE, timeout=300, cwd=ROOT)
    os.close(w)
    assert out.returncode == 1 and out.stderr == b"", out.stderr
