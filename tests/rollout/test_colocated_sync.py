"""A colocated GSPO run on the stand-in SGLang server: SGLang's memory order around every
weight sync (release all after the rollout; resume weights; stream buckets; resume kv_cache and
cuda_graph), weights lost by the release re-pushed each time, and the peak of live bucket bytes
logged in events.log and metrics.jsonl, within one bucket."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_colocated_worker.py")
BOUND = 24576  # 24 KiB: the 32 KiB tensors (embedding, MLP) travel alone, the rest is packed


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("colocated")
    out = subprocess.run([sys.executable, str(WORKER), str(work), str(BOUND)], cwd=ROOT,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_memory_order_and_live_bucket_bytes(result):
    # launch: the KV cache and CUDA graphs go back before the first sync, as at every sync
    assert result["memory_log"] == ["release kv_cache,cuda_graph", "resume kv_cache,cuda_graph"] \
        + ["release kv_cache,weights,cuda_graph", "resume weights",
           "resume kv_cache,cuda_graph"] * 2
    assert result["lost_weights"] == [] and result["weight_version"] == "2"
    run = Path(result["run_dir"])
    syncs = [ln for ln in (run / "events.log").read_text().splitlines() if "weight sync v" in ln]
    assert len(syncs) == 3
    pat = (r"weight sync v(\d): (release all -> resume weights|release kv_cache,cuda_graph) -> "
           r"(\d+) buckets -> resume kv_cache,cuda_graph; peak live bucket bytes (\d+) "
           rf"\(largest bucket (\d+), bound {BOUND}\)")
    biggest = max(result["tensor_bytes"].values())
    assert biggest > BOUND
    for v, line in enumerate(syncs):
        m = re.search(pat, line)
        assert m, line
        assert int(m[1]) == v and m[2].startswith("release all") == (v > 0)  # v0: weights kept
        assert int(m[4]) <= int(m[5]) == max(BOUND, biggest)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    total = sum(result["tensor_bytes"].values()) - result["tensor_bytes"]["lm_head.weight"]
    for r in rows:
        assert r["weight_sync/bytes"] == total  # tied lm_head is not sent
        assert r["weight_sync/peak_live_bucket_bytes"] <= r["weight_sync/max_bucket_bytes"]
        assert r["weight_sync/max_bucket_bytes"] == max(BOUND, biggest)
        assert r["weight_sync/buckets"] > total / (2 * BOUND)
        assert r["weight_sync/peak_live_bucket_bytes"] < total / 4  # never the whole model


def test_learner_offloaded_while_servers_generate(result):
    """rollout.offload_learner (on by default here): after every sync the learner's weights,
    gradient buffer and Adam moments are off the device, the bytes the memory plan predicts."""
    from megatron_gspo.megatron.memory import plan as mp

    run = Path(result["run_dir"])
    hf = json.loads((run.parent / "model" / "config.json").read_text())
    plan = mp.learner_bytes(mp.dims_from_hf(hf), param_bytes=4)  # examples/tiny: float32
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["memory/learner_offloaded_bytes"] for r in rows] == [plan.total] * len(rows)
    assert plan.moments > 0 and plan.grads == plan.weights


IPC_WORKER = Path(__file__).with_name("_ipc_worker.py")


def _two_ranks(mode):
    from megatron_gspo.megatron.parallel import free_port

    port = free_port()
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(IPC_WORKER), str(r), str(port), mode],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(next(x for x in o.splitlines() if x.startswith("RESULT "))[7:])
            for o, _ in outs]


@pytest.mark.slow
def test_each_tp_rank_entry_comes_from_its_learner_rank():
    r0, r1 = _two_ranks("same")
    assert r0["ok"] and r1["ok"] and r0["version"] == "7" and r0["equal"]
    assert r0["stats"]["requests"] == r0["stats"]["buckets"] > 1
    # Rank 1 serializes other tensors: the server's TP rank 1 sees them (its entry is rank 1's
    # copy) and the server ends as SGLang's scheduler does on a failed load; every learner rank
    # fails with the same one-line error and no new version is served.
    r0, r1 = _two_ranks("mismatch")
    assert "TP rank 1's entry holds other tensors" in r0["died"]
    assert "update_weights_from_tensor failed" in r0["error"] and "\n" not in r0["error"]
    assert r0["error"] == r1["error"] and r0["version"] != "7"


def test_entry_rank_plan_follows_gpus_of_the_first_node():
    from megatron_gspo.rollout.engine import RolloutError
    from megatron_gspo.rollout.multinode.colocated import plan_entry_ranks

    infos = [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0), ("b", 1)]
    assert plan_entry_ranks(infos, num_servers=2, tp_size=2) == [[0, 1], [2, 3]]
    with pytest.raises(RolloutError, match="server 1 TP rank 1 runs on GPU 3 of the first node"):
        plan_entry_ranks(infos[:3] + infos[4:], num_servers=2, tp_size=2)
