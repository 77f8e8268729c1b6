"""bench/async_rollout.py runs end to end (short): a stand-in server process, one sync and one
async run of the tiny demo with the same trained samples, the table and the `ratio=` line."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_async_bench_prints_table_and_ratio(tmp_path):
    out = subprocess.run([sys.executable, "bench/async_rollout.py", "--steps", "3", "--repeats",
                          "1", "--keep", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"ratio=\d+\.\d{3}", lines[-1]), lines[-1]
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.startswith(("sync ", "async "))}
    assert rows["sync"][2] == rows["async"][2] == str(3 * 16 * 8)  # equal trained samples
    assert int(rows["async"][7]) <= 1 and int(rows["sync"][7]) == 0  # staleness max
