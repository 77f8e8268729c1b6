"""Launched servers and the distributed weight sync from a real torchrun worker.

torchrun gives its workers TORCHELASTIC_USE_AGENT_STORE=True (torch
distributed/elastic/agent/server/local_elastic_agent.py); with it torch's `tcp://` rendezvous
makes every rank a store client. A server launched from such a worker must not inherit it (its
own TP group would never form), and the learner's side of the weight-update group must host
its store itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from megatron_gspo.rollout.sglang.launch import (LEARNER_ONLY_ENV, LaunchSpec, launch_environ,
                                                 pick_ports, server_env)

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "rollout" / "_torchrun_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_environment_drops_torchrun_variables():
    base = {"PATH": "/bin", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x",
            "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", "GROUP_RANK": "0", "ROLE_NAME": "default",
            "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "CUDA_VISIBLE_DEVICES": "0,1", "HF_HOME": "/hf"}
    env = launch_environ(base)
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1", "HF_HOME": "/hf"}
    assert set(LEARNER_ONLY_ENV) >= {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    # spec.env still reaches the server, on top of the cleaned environment
    assert server_env(LaunchSpec(model_path="m", env={"RANK": "7"}))["RANK"] == "7"


@pytest.mark.slow
def test_servers_and_weight_sync_from_a_torchrun_worker(tiny_model_dir, tmp_path):
    # A stand-in server started outside torchrun (clean environment): the worker syncs into it.
    # Its port as the launcher picks one: at most 55535 (SGLang, and the stand-in, refuse a
    # port whose +10000 gRPC port is out of range)
    port = pick_ports("127.0.0.1", 0, 1)[0]
    clean = {k: v for k, v in os.environ.items() if k not in LEARNER_ONLY_ENV}
    clean.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    server_log = open(tmp_path / "attached_server.log", "wb")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "-m", "megatron_gspo.rollout.standin.server", "--model-path",
         tiny_model_dir, "--port", str(port), "--dtype", "float32"],
        env=clean, stdout=server_log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:  # until the attached server answers /health
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, \
                    (tmp_path / "attached_server.log").read_text()[-2000:]
                time.sleep(0.5)
        out = tmp_path / "worker"
        out.mkdir()
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(WORKER),
             tiny_model_dir, str(out), f"http://127.0.0.1:{port}"],
            env=clean, capture_output=True, text=True, timeout=400, cwd=ROOT)
        res = json.loads((out / "result.json").read_text()) if (out / "result.json").is_file() \
            else {}
        logs = "".join(p.read_text(errors="replace")[-1500:] for p in out.glob("*.log"))
        assert r.returncode == 0, f"{res}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}\n{logs}"
    finally:
        server.terminate()
        server.wait(30)
        server_log.close()
    assert res["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # really torchrun's workers
    assert res["attached"] == {"changed": True, "version": 1}
    assert res["launched"] == {"healthy": True, "changed": True, "version": 3}
