"""Two jobs on one machine (issue 54, defect 2): each job's launch holds its server ports from
the pick to the server's end, and every launched server proves it is this run's (its
`--served-model-name` token, read back from `/server_info`) before anything else is sent."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from megatron_gspo.rollout.sglang import launch, lifecycle as servers
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.sglang.launch import LaunchSpec, PortHold, pick_ports, server_argv

STANDIN = "megatron_gspo.rollout.standin.server"


def _free_base(span: int = 4) -> int:
    """A port p with p .. p + span - 1 free now (under SGLang's 55535)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + span <= launch.MAX_SERVER_PORT and all(
                launch.port_is_free("127.0.0.1", q) for q in range(p, p + span)):
            return p
    raise RuntimeError("no free port span")


def test_each_launch_has_its_own_token_in_the_server_argv():
    a, b = LaunchSpec(model_path="m"), LaunchSpec(model_path="m")
    assert a.run_token != b.run_token and ":" not in a.run_token  # SGLang refuses ':'
    argv = server_argv(a, 0, 30000)
    assert argv[argv.index("--served-model-name") + 1] == a.run_token
    with pytest.raises(ValueError, match="--served-model-name"):
        LaunchSpec(model_path="m", extra_args=["--served-model-name", "mine"])


def test_held_ports_are_not_picked_by_another_job():
    """Job A's pick holds its ports (an flock per port, machine-wide) until it lets them go;
    job B, picking from the same base before A's servers bind, gets other ports."""
    base = _free_base()
    a, b = PortHold(), PortHold()
    try:
        got_a = pick_ports("127.0.0.1", base, 2, hold=a)
        got_b = pick_ports("127.0.0.1", base, 2, hold=b)
        assert got_a == [base, base + 1] and not set(got_a) & set(got_b)
        a.release()
        assert pick_ports("127.0.0.1", base, 1, hold=b) == [base]
    finally:
        a.release()
        b.release()


def _job(spec: LaunchSpec) -> SGLangEngine:
    return SGLangEngine(launch=spec, backoff_s=0.01, max_retries=0, startup_timeout_s=180)


@pytest.mark.slow
def test_two_jobs_racing_for_one_base_port_drive_only_their_own_servers(tiny_model_dir,
                                                                         tmp_path):
    """Two launches from the same base port at the same moment (before either server binds):
    distinct ports, each server answers with its own job's token, each job generates on its
    own server, and ending one job leaves the other's server serving."""
    base = _free_base()
    specs = [LaunchSpec(model_path=tiny_model_dir, module=STANDIN, base_port=base,
                        python=sys.executable, log_dir=str(tmp_path / f"job{i}"),
                        dtype="float32") for i in range(2)]
    jobs = [_job(s) for s in specs]
    errors: list[BaseException] = []

    def start(eng: SGLangEngine) -> None:
        try:
            eng.sync(eng.astart())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(j,)) for j in jobs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not errors, errors
        assert not set(jobs[0].urls) & set(jobs[1].urls), [j.urls for j in jobs]
        for job, spec in zip(jobs, specs, strict=True):
            info = job.server_info[job.urls[0]]
            assert info["served_model_name"] == spec.run_token
            out = job.generate([GenerateRequest([4, 5, 6], SamplingParams(max_new_tokens=3))])
            assert {s.metadata["server"] for s in out} == set(job.urls)
        jobs[0].shutdown()
        out = jobs[1].generate([GenerateRequest([4, 5], SamplingParams(max_new_tokens=3))])
        assert len(out) == 1 and all(p.alive() for p in jobs[1].procs)
    finally:
        for j in jobs:
            j.shutdown()


@pytest.mark.slow
def test_a_server_that_is_not_this_runs_is_refused_naming_whose(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """Another job's server already answers on the port this launch picked (the pick raced its
    bind): this launch's own server cannot bind, but /health of the port answers 200. The
    launch stops with one line naming the other server's token and launcher pid, and sends it
    nothing else (no generation, no memory or weight call)."""
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.standin.server import StandinServer

    other_token = "megatron-gspo-pid4242-0123456789ab"
    other = StandinServer(EmbeddedEngine(tiny_model_dir, dtype="float32"),
                          model_path=tiny_model_dir, served_model_name=other_token)
    other.start_in_thread()
    try:
        monkeypatch.setattr(servers, "pick_ports",
                            lambda host, base, count, **kw: [other.port][:count])
        spec = LaunchSpec(model_path=tiny_model_dir, module=STANDIN, base_port=other.port,
                          python=sys.executable, log_dir=str(tmp_path), dtype="float32")
        eng = _job(spec)
        with pytest.raises(RolloutError) as err:
            eng.sync(eng.astart())
        msg = str(err.value)
        assert "\n" not in msg and other_token in msg and "pid 4242" in msg, msg
        assert spec.run_token in msg and "not this run's" in msg, msg
        assert other.stats["generate_calls"] == 0 and other.memory_log == []
        assert other.stats["weight_updates"] == 0
        eng.shutdown()
    finally:
        other.stop_thread()


def test_standin_echoes_served_model_name_as_sglang_does(tiny_model_dir):
    """SGLang's /server_info lists ServerArgs: served_model_name is the flag's value, else the
    model path (server_args.py `__post_init__`); a ':' is refused at start."""
    import asyncio

    import aiohttp

    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.standin import server as standin_server

    eng = EmbeddedEngine(tiny_model_dir, dtype="float32")
    plain = standin_server.StandinServer(eng, model_path=tiny_model_dir).start_in_thread()
    named = standin_server.StandinServer(eng, model_path=tiny_model_dir,
                                         served_model_name="run-1").start_in_thread()

    async def info(url: str) -> dict:
        async with aiohttp.ClientSession() as s, s.get(url + "/get_server_info") as r:
            return await r.json()

    try:
        assert asyncio.run(info(plain.url))["served_model_name"] == tiny_model_dir
        assert asyncio.run(info(named.url))["served_model_name"] == "run-1"
    finally:
        plain.stop_thread()
        named.stop_thread()
    with pytest.raises(ValueError, match="served_model_name cannot contain a colon"):
        standin_server.main(["--model-path", tiny_model_dir, "--port", "3000",
                             "--served-model-name", "a:b"])
