"""tools/plot_metrics.py draws a PNG from metrics.jsonl and fails clearly without one."""

import subprocess
import sys
from pathlib import Path

from megatron_gspo.runtime.metrics import MetricsLogger

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_metrics.py"


def test_plot_png(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False, progress_bar=False)
    for s in range(5):
        log.log(s, {"reward/mean": s / 5, "clip_fraction": 0.1, "time/step": 1.0 + s,
                    "precision/seq_abs_mismatch_mean": 1e-4 * s})
    log.close()
    out = subprocess.run([sys.executable, str(TOOL), str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_without_metrics_fails(tmp_path):
    out = subprocess.run([sys.executable, str(TOOL), str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode != 0 and "no metrics" in out.stderr
