"""`rollout.weight_sync_delta` in the training loop (tests/rollout/_delta_worker.py: the tiny
demo on a stand-in server with the delta loader, the sync probe at every step): deltas after the
first sync, the served log-probs equal to the learner's after every sync, a probe mismatch after
a delta sync followed at once by a full sync of the same version, and a resumed run starting
with a full sync."""

from __future__ import annotations

import json
import os
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


@pytest.mark.slow
@pytest.mark.parametrize("dtype,offload", [("float32", "true"), ("bfloat16", "true"),
                                           ("float32", "false")])
def test_colocated_deltas_on_launched_servers(tmp_path, dtype, offload):
    """The combination docs/weight-sync.md offers for 8B: colocated servers launched by the run,
    the learner offloaded while they generate (rollout.offload_learner, on by default; also
    off), deltas on, the sync probe at every step. It crashed at the first sync: a segfault when the
    offloaded learner came back (the full encoding handed a live parameter's host storage to
    shared memory) and, with the learner not offloaded, a KeyError on the stream's stats."""
    from megatron_gspo.rollout.sglang.weight_sync_endpoints import PROBE_TOLERANCE

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "SGLANG_SERVER_MODULE": "megatron_gspo.rollout.standin.server"}
    out = subprocess.run([sys.executable, str(WORKER), str(tmp_path), json.dumps([
        "rollout.weight_sync_delta=on", "rollout.colocate=true", "rollout.num_servers=1",
        "rollout.startup_timeout=240", f"model.dtype={dtype}",
        f"rollout.offload_learner={offload}"])],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, (out.returncode, out.stderr[-3000:])
    (rows,) = json.loads(line[len("RESULT "):])["runs"]
    sync = [{k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("weight_sync/")}
            for r in rows]
    assert len(sync) == 3 and all(s["delta"] == 1.0 for s in sync)
    assert all(s["probe_max_diff"] < PROBE_TOLERANCE[dtype] for s in sync)
    assert all(s["delta_bytes_sent"] < s["delta_bytes_full"] for s in sync)
    assert all(s["bytes"] == s["delta_bytes_sent"] and s["buckets"] >= 1 for s in sync)
    assert all((r.get("memory/learner_offloaded_bytes", 0) > 0) == (offload == "true")
               for r in rows)  # offloaded, and back for the probe and the next step
    events = (tmp_path / "run" / "events.log").read_text()
    assert "weight sync v0: full (first sync)" in events
    assert "weight sync v3: release kv_cache,cuda_graph -> " in events  # the KV cache only


@pytest.mark.slow
def test_delta_retry_gets_the_room_of_a_sync(tmp_path):
    """The full re-sync after a failed delta probe, colocated, in the device-memory ledger of
    qwen3_8b_1node (80 GB GPUs, `megatron-gspo plan --ledger-spec` with deltas on): the probe's
    `learner_room` gave the servers their KV cache and CUDA graphs back, and the re-sync brought
    the learner's weights in next to them (the issue's 75-78 GiB estimate). It must run in the
    room a normal sync gets: its moment ("delta retry", the re-sync from its start to its
    stream's end) peaks no higher than a normal sync's, and no moment leaves the plan."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from device_ledger import switches, table, write_spec  # scripts/device_ledger.py

    spec = write_spec(tmp_path / "qwen3_8b_1node.json", "qwen3_8b_1node",
                      ["rollout.weight_sync_delta=on"])
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "MEGATRON_GSPO_DEVICE_LEDGER": str(spec)}
    env.pop("SGLANG_SERVER_MODULE", None)  # the worker's own server: its loader is tampered
    overrides = ["rollout.weight_sync_delta=on", "rollout.colocate=true",
                 *switches("qwen3_8b_1node")]
    out = subprocess.run([sys.executable, str(WORKER), str(tmp_path), json.dumps(overrides), "3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, (out.returncode, out.stderr[-3000:])
    (rows,) = json.loads(line[len("RESULT "):])["runs"]
    assert [r.get("weight_sync/delta_probe_retries", 0.0) for r in rows] == [0.0, 0.0, 1.0]
    rep = json.loads(Path(f"{spec}.report.json").read_text())
    print(table("qwen3_8b_1node", {"fresh": rep, "resume": {"moments": [], "problems": []}}))
    peaks = {r["moment"]: r["peak_bytes"] for r in rep["moments"]}
    assert rep["problems"] == [], rep["problems"]
    assert peaks["delta retry"] <= peaks["weight sync"], peaks
