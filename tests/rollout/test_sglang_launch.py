"""Server launch: SGLang command lines, and launched (stand-in) server processes end to end."""

from __future__ import annotations

import socket
import sys

import pytest
import torch

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from megatron_gspo.rollout.sglang import launch
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.sglang.launch import (DIST_PORT_RANGE, LaunchSpec, check_local_gpus,
                                                 pick_dist_port, router_argv, server_argv)

STANDIN = "megatron_gspo.rollout.standin.server"


def test_server_argv_matches_sglang_flags():
    spec = LaunchSpec(
        model_path="/models/qwen3", num_servers=2, tp_size=2, host="127.0.0.1",
        mem_fraction_static=0.7, colocated=True, base_gpu_id=4, seed=11, dtype="bfloat16",
        extra_args=["--context-length", "8192"], python="/usr/bin/python3",
    )
    assert server_argv(spec, 1, 30001) == [
        "/usr/bin/python3", "-m", "sglang.launch_server",
        "--model-path", "/models/qwen3", "--host", "127.0.0.1", "--port", "30001",
        "--tp-size", "2", "--base-gpu-id", "6", "--random-seed", "12", "--dtype", "bfloat16",
        "--served-model-name", spec.run_token,  # the run's identity (issue 54)
        "--mem-fraction-static", "0.7", "--enable-memory-saver",
        "--context-length", "8192",
    ]
    plain = server_argv(LaunchSpec(model_path="m", python="py"), 0, 30000)
    assert "--enable-memory-saver" not in plain and "--mem-fraction-static" not in plain
    assert router_argv(["http://a:1", "http://b:2"], "127.0.0.1", 31000, python="py") == [
        "py", "-m", "sglang_router.launch_router", "--worker-urls", "http://a:1", "http://b:2",
        "--host", "127.0.0.1", "--port", "31000", "--policy", "cache_aware",
    ]
    with pytest.raises(ValueError, match="mem_fraction_static"):
        LaunchSpec(model_path="m", mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="server_urls"):
        SGLangEngine()
    with pytest.raises(ValueError, match="dist_master"):
        SGLangEngine(server_urls=["http://x:1"], weight_sync="distributed")


def test_dist_port_is_picked_under_the_ephemeral_range_and_passed(monkeypatch):
    """Each launched server gets its torch.distributed store's port from the launcher
    (`--nccl-port`): free, under the kernel's ephemeral range, distinct within a launch."""
    import random

    ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    rng, taken = random.Random(0), [30000, 30001]
    for _ in range(20):
        taken.append(pick_dist_port(taken, rng))
    picks = taken[2:]
    assert len(set(picks)) == len(picks)
    assert all(DIST_PORT_RANGE[0] <= p < min(DIST_PORT_RANGE[1] + 1, ephemeral_low)
               for p in picks)
    with socket.socket() as busy:  # a port in use is never handed out
        busy.bind(("127.0.0.1", picks[0]))
        busy.listen()
        monkeypatch.setattr(launch, "DIST_PORT_RANGE", (picks[0], picks[0] + 1))
        assert {pick_dist_port([], random.Random(i)) for i in range(8)} == {picks[0] + 1}
        assert pick_dist_port([picks[0] + 1]) >= ephemeral_low  # none left: the OS's pick
    spec = LaunchSpec(model_path="m", python="py")
    assert server_argv(spec, 0, 30000, 25001)[-2:] == ["--nccl-port", "25001"]
    assert "--nccl-port" not in server_argv(spec, 0, 30000)
    own = LaunchSpec(model_path="m", python="py", extra_args=["--nccl-port", "24000"])
    assert server_argv(own, 0, 30000, 25001).count("--nccl-port") == 1  # the user's wins


def test_launch_must_fit_on_the_node():
    check_local_gpus(LaunchSpec(model_path="m", num_servers=4, tp_size=2), 8)
    check_local_gpus(LaunchSpec(model_path="m", num_servers=64), 0)  # no CUDA: stand-in servers
    with pytest.raises(ValueError, match=r"num_servers=8 x rollout.tp_size=2 .* needs 16 GPUs "
                                         r"on this node, which has 8"):
        check_local_gpus(LaunchSpec(model_path="m", num_servers=8, tp_size=2), 8)
    with pytest.raises(ValueError, match="needs 9 GPUs"):
        check_local_gpus(LaunchSpec(model_path="m", num_servers=1, base_gpu_id=8), 8)


def test_server_that_dies_at_startup_fails_clearly(tmp_path):
    spec = LaunchSpec(model_path="m", module="megatron_gspo.rollout.no_such_module",
                      base_port=0, python=sys.executable, log_dir=str(tmp_path))
    eng = SGLangEngine(launch=spec, startup_timeout_s=120)
    with pytest.raises(RolloutError, match=r"exited with code 1 .*before becoming healthy"):
        eng.sync(eng.astart())
    assert all(not p.alive() for p in eng.procs)
    assert "No module named" in (tmp_path / "sglang_server_0.log").read_text()
    eng.shutdown()


@pytest.mark.slow
def test_launched_servers_generate_update_and_crash(tiny_model_dir, tmp_path):
    """A launched server process: generation, CPU shared-memory tensor update, gloo broadcast
    update, then a crash makes the call fail and stops the server."""
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors across processes
    spec = LaunchSpec(model_path=tiny_model_dir, num_servers=1, module=STANDIN, base_port=0,
                      python=sys.executable, log_dir=str(tmp_path), dtype="float32")
    eng = SGLangEngine(launch=spec, backoff_s=0.01, max_retries=1, startup_timeout_s=120)
    try:
        reqs = [GenerateRequest([4, 5, 6], SamplingParams(max_new_tokens=6, n=4))]
        out = eng.generate(reqs)
        assert len(out) == 4 and {s.metadata["server"] for s in out} == set(eng.urls)
        assert all(p.alive() for p in eng.procs) and len(eng.urls) == 1

        greedy = [GenerateRequest([4, 5, 6], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                            ignore_eos=True, n=2))]
        base = eng.generate(greedy)
        from safetensors.torch import load_file

        weights = load_file(f"{tiny_model_dir}/model.safetensors")
        shifted = [(k, v + 0.3) for k, v in weights.items()]
        eng.update_weights([shifted], version=1)
        upd = eng.generate(greedy)
        assert [s.weight_version for s in upd] == [1, 1]
        assert upd[0].response_ids == upd[1].response_ids != base[0].response_ids

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        eng.weight_sync, eng.dist_backend = "distributed", "gloo"
        eng.dist_master = ("127.0.0.1", port)
        eng.update_weights([list(weights.items())], version=2)  # connects, then broadcasts
        back = eng.generate(greedy)
        assert [s.weight_version for s in back] == [2, 2]
        assert [s.response_ids for s in back] == [s.response_ids for s in base]

        eng.sync(eng._post(eng.urls[0], "/standin/faults", {"crash": True}))
        with pytest.raises(RolloutError, match="exited with code 1.*stopped the rollout servers"):
            eng.generate(reqs)
        assert all(not p.alive() for p in eng.procs)
    finally:
        eng.shutdown()
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
    assert all(p.returncode is not None for p in eng.procs)


class _FakeSocket:
    """socket.socket stand-in whose bind(port 0) yields the next scripted port."""

    def __init__(self, ports):
        self.ports, self.port = ports, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, addr):
        self.port = next(self.ports) if addr[1] == 0 else addr[1]

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_launched_ports_stay_within_sglang_grpc_rule(monkeypatch):
    """SGLang refuses --port above 55535 (port + 10000 is its gRPC port, <= 65535)."""
    from megatron_gspo.rollout.sglang import launch as sglang_launch

    ports = iter([60001, 55536, 40000, 40000, 41000])
    monkeypatch.setattr(sglang_launch.socket, "socket", lambda *a, **k: _FakeSocket(ports))
    assert sglang_launch.pick_ports("127.0.0.1", 0, 2) == [40000, 41000]
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="55535"):
        sglang_launch.pick_ports("127.0.0.1", 55535, 2)
    with pytest.raises(ValueError, match=r"rollout.base_port .*55535"):
        LaunchSpec(model_path="m", base_port=60000)
    from megatron_gspo.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="rollout.base_port"):
        config_from_dict({"rollout": {"base_port": 56000}})


def test_standin_refuses_ports_sglang_refuses(monkeypatch):
    from megatron_gspo.rollout.standin import server as standin_server

    monkeypatch.delenv("SGLANG_GRPC_PORT", raising=False)
    with pytest.raises(ValueError, match=r"SGLANG_GRPC_PORT \(70000\) must be between 1 and "
                                         r"65535"):
        standin_server.main(["--model-path", "/nonexistent", "--port", "60000"])
    monkeypatch.setenv("SGLANG_GRPC_PORT", "70001")
    with pytest.raises(ValueError, match=r"SGLANG_GRPC_PORT \(70001\)"):
        standin_server.main(["--model-path", "/nonexistent", "--port", "3000"])


def test_launch_env_and_argv_health_api_key():
    from megatron_gspo.rollout.sglang.launch import redact_argv, server_env

    spec = LaunchSpec(model_path="m", python="py", api_key="k3y", env={"A": "1"})
    env = server_env(spec)
    assert env == {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0", "A": "1"}
    argv = server_argv(spec, 0, 30000)
    assert argv[argv.index("--api-key") + 1] == "k3y"
    assert "k3y" not in " ".join(redact_argv(argv)) and "--api-key" in redact_argv(argv)
    assert "k3y" not in repr(spec)
    r = router_argv(["http://a:1"], "127.0.0.1", 31000, python="py", api_key="k3y")
    assert r[r.index("--api-key") + 1] == "k3y"
    assert "--api-key" not in server_argv(LaunchSpec(model_path="m"), 0, 30000)


@pytest.mark.slow
def test_launched_server_gets_health_env_and_api_key(tiny_model_dir, tmp_path):
    """A launched (stand-in) server process: /health does not generate (so it answers while
    memory is released), the key is required, and the client sends it everywhere."""
    import asyncio

    import aiohttp

    spec = LaunchSpec(model_path=tiny_model_dir, module=STANDIN, base_port=0,
                      python=sys.executable, log_dir=str(tmp_path), dtype="float32",
                      api_key="k3y", extra_args=["--context-length", "64"])
    eng = SGLangEngine(launch=spec, backoff_s=0.01, startup_timeout_s=120)

    async def status(path):
        async with aiohttp.ClientSession() as s, s.get(eng.urls[0] + path) as r:
            return r.status

    try:
        out = eng.generate([GenerateRequest([4] * 60, SamplingParams(max_new_tokens=20, n=2))])
        assert [len(s.response_ids) <= 4 for s in out] == [True, True]  # capped to 64
        assert eng.context_length == 64 and eng.metrics["capped"] == 2
        eng.release_memory()
        assert asyncio.run(status("/health")) == 200
        assert asyncio.run(status("/health_generate")) == 503
        assert asyncio.run(status("/model_info")) == 401
        eng.resume_memory()
        assert len(eng.generate([GenerateRequest([4, 5], SamplingParams(max_new_tokens=3))])) == 1
    finally:
        eng.shutdown()
    assert "k3y" not in (tmp_path / "sglang_server_0.log").read_text()
