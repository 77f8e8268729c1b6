"""Automatic restart under a real torchrun with SGLang's real CPU server (tier `sglang_real`,
issue 45): `python -m torch.distributed.run --standalone --nproc_per_node=2 --max-restarts=3`
of the tiny demo (TP2, a checkpoint every step), rank 0 launching one colocated real server.
Rank 1 is killed with -9 inside the weight sync of version 2 (round 0) and rank 0 inside the
sync of version 3 (round 1), each once the first 1 MiB bucket reached the server (the fault
`kill_rank<R>_in_sync@V#N`, runtime/faults.py), so the server holds a mix of two weight versions.
With no person acting the job ends 0: two automatic restarts and resumes in events.log, a
metrics row for every step, the syncs after the last resume verified by the probe
(`rollout.verify_sync_interval=1`) on the new server each round launched (a new pid), every
COMPLETE checkpoint verifies, no lock, and no process of the job left: torchrun, the ranks of
every round, every process carrying the job's TIER_RUN_TAG and every process in a server's
session (each round's server with its scheduler and detokenizer). The checks are
tests/rollout/chaos_sglang_real.py's, whose `--rounds` loop is the multi-round version.

The rows are not compared with an uninterrupted run's, and the job runs with
train.deterministic=false: a real server samples the same tokens for a request again only with
per-request seeds, which SGLang honours only under `--enable-deterministic-inference`, and that
needs the fa3, flashinfer or triton attention backend (server_args.py
`_handle_deterministic_inference` refuses any other), none of which runs on CPU (the CPU
server runs torch_native)."""

from __future__ import annotations

import random
import time

import pytest

from tests.rollout import _sglang_real as tier

tier.require_tier()
pytestmark = pytest.mark.sglang_real


@pytest.mark.timeout(1500)
def test_rank1_then_rank0_killed_inside_syncs_restart_by_themselves(tmp_path):
    from tests.rollout import chaos_sglang_real as real

    t0 = time.monotonic()
    fault = "kill_rank1_in_sync@2#0,kill_rank0_in_sync@3#1"
    job, tag, watch = real.start(tmp_path / "run", real.free_base_port(random.Random()), fault)
    code = job.finish(real.RUN_TIMEOUT)
    problems = real.check(job, tag, watch, code, restarts=2)
    seen = watch.seen
    done = real.ct.failures(job.run)
    print(f"SGLang {tier.version()}: {time.monotonic() - t0:.0f} s, restarts "
          f"{[(f['round'], f['step']) for f in done]}, servers (pid: round) {seen}")
    assert problems == [], problems
    assert [(f["round"], f["step"]) for f in done] == [(0, 1), (1, 2)], done
