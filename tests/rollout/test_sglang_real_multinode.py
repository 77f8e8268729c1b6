"""Colocated generation on every node against SGLang's real CPU server (tier `sglang_real`): two
plain torchrun launches of `megatron-gspo train` on localhost (--nnodes=2, 2 ranks each,
parallel.tensor=2), each node leader launching one real server through the project's launcher.
Every weight sync reaches both nodes' servers by the per-node tensor sync and is verified by
the sync probe on every server (`rollout.verify_sync_interval=1`); every launched server is gone
when the job ends. The stand-in version with a server dying mid-rollout is
tests/rollout/test_multinode.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.rollout import _sglang_real as tier
from tests.rollout.test_sglang_real_training import COMMON, _servers

tier.require_tier()
pytestmark = pytest.mark.sglang_real

STEPS = 3


@pytest.mark.timeout(1800)
def test_two_nodes_train_on_real_servers_with_every_sync_verified(tmp_path):
    from megatron_gspo.megatron.parallel import free_port
    from megatron_gspo.rollout.sglang.launch import pick_ports

    run, tag = tmp_path / "run", uuid.uuid4().hex
    port, base = free_port(), pick_ports("127.0.0.1", 21000, 1)[0]
    procs = []
    for node in (0, 1):
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", TIER_RUN_TAG=tag)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               f"--node-rank={node}", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={port}", "-m", "megatron_gspo.cli", "train",
               "examples/tiny/config.yaml", "--run-dir", str(run), *COMMON, *tier.train_args(),
               "rollout.colocate=true", "rollout.num_servers=1", f"rollout.base_port={base}",
               "parallel.tensor=2", f"train.max_steps={STEPS}", "train.prompts_per_step=4",
               "rollout.group_size=4", "checkpoint.interval=0"]
        procs.append(subprocess.Popen(cmd, cwd=tier.ROOT, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    ends = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=1500)
            ends.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, err in ends:
        assert rc == 0, err[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:
        assert r["weight_sync/nodes"] == 2 and r["weight_sync/servers"] == 2, r
        assert r["rollout/samples"] == 16 and r["rollout/engine_failed_total"] == 0
        assert r["weight_sync/probe_max_diff"] < 1e-3  # fp32: both nodes' servers verified
    print(f"two nodes on real servers: probe max diff "
          f"{max(r['weight_sync/probe_max_diff'] for r in rows):.2g}")
    assert _servers(tag) == []
