"""`rollout.weight_sync_delta` in the training loop (tests/rollout/_delta_worker.py: the tiny
demo on a stand-in server with the delta loader, the sync probe at every step): deltas after the
first sync, the served log-probs equal to the learner's after every sync, a probe mismatch after
a delta sync followed at once by a full sync of the same version, and a resumed run starting
with a full sync."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "_delta_worker.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_deltas_probe_mismatch_and_resume(tmp_path):
    out = subprocess.run([sys.executable, str(WORKER), str(tmp_path),
                          json.dumps(["rollout.weight_sync_delta=on"]), "3", "5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    first, resumed = got["runs"]
    sync = [{k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("weight_sync/")}
            for r in first + resumed[len(first):]]
    assert len(sync) == 5 and all(s["probe_max_diff"] < 1e-3 for s in sync)
    # step 2's sync (version 3) was a delta on a base the server's loader no longer held
    # right: the probe failed, the same version went out in full and was verified
    assert sync[2]["delta"] == 0.0 and sync[2]["delta_probe_retries"] == 1.0
    assert sync[2]["delta_tensors_full"] == 47  # every tensor of the tiny model, whole
    assert all(s["delta"] == 1.0 for i, s in enumerate(sync) if i != 2)
    assert all(s["delta_bytes_sent"] < s["delta_bytes_full"] for i, s in enumerate(sync)
               if i != 2)
    events = (tmp_path / "run" / "events.log").read_text()
    assert events.count("full (first sync)") == 2  # the fresh run and the resumed one
    assert "weight sync v3: full (sync probe mismatch)" in events
    assert got["weight_version"] == "5" and got["died"] is None
