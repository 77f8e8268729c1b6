"""Launch scripts under docker/launch: syntax (bash -n), shellcheck, and the command lines their
dry runs build for one and two nodes, colocated and disaggregated, directly and under SLURM."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "docker" / "launch"
SCRIPTS = sorted(p for p in (ROOT / "docker").rglob("*") if p.suffix in (".sh", ".sbatch"))
CLEAN_ENV = ("NNODES", "NODE_RANK", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "LOG_DIR",
             "ROLLOUT_TP", "ROLLOUT_MEM_FRACTION", "ROLLOUT_URLS", "ROLLOUT_BASE_PORT",
             "ROLLOUT_NODES", "PLACEMENT", "IMAGE", "MODEL_DIR", "DRY_RUN", "SGLANG_EXTRA_ARGS",
             "TORCHRUN", "MEGATRON_GSPO", "ROLLOUT_HOST", "ROLLOUT_DTYPE", "SGLANG_API_KEY",
             "SGLANG_SERVER_MODULE", "PYTHON", "MAX_RESTARTS", "MONITOR_INTERVAL",
             "SKIP_PLAN", "GPU_MEMORY", "MODEL_CONFIG", "ROLLOUT_NUM_SERVERS")


def run(script: str, *args: str, env: dict[str, str] | None = None, path_prefix: str = "",
        plan: bool = False):
    """The script's output; without `plan` the memory plan is skipped (SKIP_PLAN=1: these
    tests check command lines of made-up configs; tests/docker/test_launch_plan.py checks the
    plan); `megatron-gspo` resolves to this environment's."""
    e = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV and not k.startswith("SLURM")}
    e["PATH"] = f"{Path(sys.executable).parent}:{e['PATH']}"
    if path_prefix:
        e["PATH"] = f"{path_prefix}:{e['PATH']}"
    if not plan:
        e["SKIP_PLAN"] = "1"
    e.update(env or {})
    return subprocess.run(["bash", str(LAUNCH / script), *args], check=False, env=e,
                          capture_output=True, text=True, timeout=240 if plan else 30, cwd=ROOT)


def argv_lines(out: str) -> list[list[str]]:
    return [shlex.split(ln) for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]


def split_torchrun(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """torchrun's own --k=v options and the program's argv after --no-python."""
    assert argv[0] == "torchrun", argv
    i = argv.index("--no-python")
    opts = dict(a[2:].split("=", 1) for a in argv[1:i])
    return opts, argv[i + 1:]


def overrides_of(program: list[str]) -> list[str]:
    return [a for a in program if "=" in a and not a.startswith("-")]


def assert_valid_overrides(program: list[str]) -> None:
    """Every key=value the scripts add is a real config field with a valid value."""
    load_config(None, [*overrides_of(program), "model.path=/models/tiny"])


def test_scripts_exist_and_are_executable():
    names = {p.name for p in SCRIPTS}
    assert {"torchrun.sh", "colocated.sh", "disaggregated.sh", "slurm.sbatch"} <= names
    for p in SCRIPTS:
        if p.name != "common.sh":
            assert p.stat().st_mode & stat.S_IXUSR, f"{p} is not executable"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_shellcheck():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck binary not installed (apt-get install -y shellcheck)")
    r = subprocess.run([exe, "-x", *map(str, SCRIPTS)], check=False, capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_torchrun_single_node():
    r = run("torchrun.sh", "--dry-run", "cfg.yaml", "--run-dir", "runs/a", "train.max_steps=3",
            env={"GPUS_PER_NODE": "8"})
    assert r.returncode == 0, r.stderr
    [argv] = argv_lines(r.stdout)
    opts, program = split_torchrun(argv)
    assert opts == {"nnodes": "1", "node-rank": "0", "nproc-per-node": "8",
                    "master-addr": "127.0.0.1", "master-port": "29500", "max-restarts": "3",
                    "monitor-interval": "5"}
    assert program == ["megatron-gspo", "train", "cfg.yaml", "--run-dir", "runs/a",
                       "train.max_steps=3"]


@pytest.mark.parametrize("rank", [0, 1])
def test_torchrun_two_nodes(rank):
    env = {"NNODES": "2", "NODE_RANK": str(rank), "GPUS_PER_NODE": "4",
           "MASTER_ADDR": "node-a", "MASTER_PORT": "6000", "LOG_DIR": "/logs/j1"}
    r = run("torchrun.sh", "--dry-run", "cfg.yaml", env=env)
    assert r.returncode == 0, r.stderr
    [argv] = argv_lines(r.stdout)
    opts, program = split_torchrun(argv)
    assert opts == {"nnodes": "2", "node-rank": str(rank), "nproc-per-node": "4",
                    "master-addr": "node-a", "master-port": "6000", "max-restarts": "3",
                    "monitor-interval": "5", "log-dir": f"/logs/j1/node{rank}", "tee": "3"}
    assert program == ["megatron-gspo", "train", "cfg.yaml"]


def test_torchrun_restarts_can_be_set_and_turned_off():
    r = run("torchrun.sh", "--dry-run", "cfg.yaml",
            env={"GPUS_PER_NODE": "2", "MAX_RESTARTS": "0", "MONITOR_INTERVAL": "1"})
    assert r.returncode == 0, r.stderr
    opts, _ = split_torchrun(argv_lines(r.stdout)[0])
    assert opts["max-restarts"] == "0" and opts["monitor-interval"] == "1"


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "2", "NODE_RANK": "1", "GPUS_PER_NODE": "8"}, "MASTER_ADDR"),
    ({"NNODES": "2", "NODE_RANK": "2", "GPUS_PER_NODE": "8", "MASTER_ADDR": "a"}, "NODE_RANK"),
    ({"GPUS_PER_NODE": "eight"}, "GPUS_PER_NODE"),
    ({"GPUS_PER_NODE": "8", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ({"GPUS_PER_NODE": "8", "MAX_RESTARTS": "-1"}, "MAX_RESTARTS"),
    ({"GPUS_PER_NODE": "8", "MONITOR_INTERVAL": "0"}, "MONITOR_INTERVAL"),
])
def test_torchrun_rejects_bad_environment(env, message):
    r = run("torchrun.sh", "--dry-run", "cfg.yaml", env=env)
    assert r.returncode == 2
    assert message in r.stderr and r.stdout == ""


def test_colocated_two_nodes():
    """The variables that are set become overrides (ROLLOUT_TP also fills the node with
    servers); the user's own overrides come last and win."""
    env = {"NNODES": "2", "NODE_RANK": "1", "GPUS_PER_NODE": "8", "MASTER_ADDR": "node-a",
           "ROLLOUT_TP": "2", "ROLLOUT_HOST": "10.1.2.3"}
    r = run("colocated.sh", "--dry-run", "cfg.yaml", "rollout.mem_fraction=0.6",
            "--run-dir", "runs/b", env=env)
    assert r.returncode == 0, r.stderr
    [argv] = argv_lines(r.stdout)
    opts, program = split_torchrun(argv)
    assert opts["nnodes"] == "2" and opts["node-rank"] == "1" and opts["nproc-per-node"] == "8"
    # --run-dir stays right after the config; the user's override comes last so it wins.
    assert program[:5] == ["megatron-gspo", "train", "cfg.yaml", "--run-dir", "runs/b"]
    assert overrides_of(program) == [
        "rollout.engine=sglang", "rollout.colocate=true", "rollout.tp_size=2",
        "rollout.num_servers=4", "rollout.host=10.1.2.3", "rollout.mem_fraction=0.6"]
    assert_valid_overrides(program)
    assert load_config(None, [*overrides_of(program), "model.path=/m"]).rollout.mem_fraction == 0.6


def test_colocated_sets_nothing_the_environment_does_not_name():
    """Without ROLLOUT_* variables the config's rollout section stands: the script adds only
    what it is (SGLang, colocated); ROLLOUT_NUM_SERVERS and ROLLOUT_MEM_FRACTION alone."""
    env = {"NNODES": "2", "NODE_RANK": "0", "GPUS_PER_NODE": "8", "MASTER_ADDR": "node-a"}
    r = run("colocated.sh", "--dry-run", "cfg.yaml", env=env)
    assert r.returncode == 0, r.stderr
    _, program = split_torchrun(argv_lines(r.stdout)[0])
    assert overrides_of(program) == ["rollout.engine=sglang", "rollout.colocate=true"]
    r = run("colocated.sh", "--dry-run", "cfg.yaml", env={
        **env, "ROLLOUT_NUM_SERVERS": "2", "ROLLOUT_MEM_FRACTION": "0.6"})
    _, program = split_torchrun(argv_lines(r.stdout)[0])
    assert overrides_of(program)[2:] == ["rollout.num_servers=2", "rollout.mem_fraction=0.6"]
    r = run("colocated.sh", "--dry-run", "cfg.yaml", env={**env, "ROLLOUT_NUM_SERVERS": "9"})
    assert r.returncode == 2 and "ROLLOUT_NUM_SERVERS" in r.stderr


def test_colocated_rejects_tp_not_dividing_gpus():
    r = run("colocated.sh", "--dry-run", "cfg.yaml", env={"GPUS_PER_NODE": "8", "ROLLOUT_TP": "3"})
    assert r.returncode == 2 and "ROLLOUT_TP" in r.stderr
    r = run("colocated.sh", "--dry-run", "cfg.yaml",
            env={"GPUS_PER_NODE": "8", "ROLLOUT_TP": "3", "ROLLOUT_NUM_SERVERS": "2"})
    assert r.returncode == 0, r.stderr  # 2 x 3 GPUs of 8: the plan judges the layout


def test_disaggregated_learner():
    urls = "http://roll-0:30000,http://roll-0:30001"
    r = run("disaggregated.sh", "--dry-run", "learner", "cfg.yaml", "train.max_steps=2",
            env={"GPUS_PER_NODE": "8", "ROLLOUT_URLS": urls})
    assert r.returncode == 0, r.stderr
    [argv] = argv_lines(r.stdout)
    _, program = split_torchrun(argv)
    assert_valid_overrides(program)
    cfg = load_config(None, [*overrides_of(program), "model.path=/m"])
    assert cfg.rollout.server_urls == urls.split(",")
    assert (cfg.rollout.engine, cfg.rollout.colocate, cfg.rollout.weight_sync) == (
        "sglang", False, "distributed")
    assert cfg.train.max_steps == 2


def test_disaggregated_learner_needs_urls():
    r = run("disaggregated.sh", "--dry-run", "learner", "cfg.yaml", env={"GPUS_PER_NODE": "8"})
    assert r.returncode == 2 and "ROLLOUT_URLS" in r.stderr
    r = run("disaggregated.sh", "--dry-run", "learner", "cfg.yaml",
            env={"GPUS_PER_NODE": "8", "ROLLOUT_URLS": "roll-0:30000"})
    assert r.returncode == 2 and "bad server URL" in r.stderr


def server_flags(out: str) -> list[dict[str, str]]:
    servers = argv_lines(out)
    for argv in servers:
        assert argv[1:3] == ["-m", "sglang.launch_server"]
    return [dict(zip(argv[3::2], argv[4::2], strict=True)) for argv in servers]


def test_disaggregated_rollout_servers():
    env = {"GPUS_PER_NODE": "8", "ROLLOUT_TP": "4", "ROLLOUT_BASE_PORT": "31000",
           "SGLANG_EXTRA_ARGS": "--random-seed 3"}
    r = run("disaggregated.sh", "--dry-run", "rollout", "/models/qwen3-8b", env=env)
    assert r.returncode == 0, r.stderr
    servers = server_flags(r.stdout)
    assert len(servers) == 2
    for i, flags in enumerate(servers):
        assert flags == {"--model-path": "/models/qwen3-8b", "--host": "127.0.0.1",
                         "--port": str(31000 + i), "--tp-size": "4", "--base-gpu-id": str(4 * i),
                         "--mem-fraction-static": "0.85", "--dtype": "bfloat16",
                         "--random-seed": "3"}
    assert r.stderr == ""


def test_disaggregated_servers_bind_loopback_unless_asked(tmp_path):
    """Servers that unpickle request bodies listen on 127.0.0.1 by default; the cluster-internal
    address ("internal": what the hostname resolves to) or any address only when asked."""
    base = {"GPUS_PER_NODE": "1"}
    r = run("disaggregated.sh", "--dry-run", "rollout", "/m", env=base)
    assert [f["--host"] for f in server_flags(r.stdout)] == ["127.0.0.1"]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "getent").write_text('#!/bin/sh\n[ "$1" = hosts ] && echo "10.1.2.3  $2"\n')
    (fake / "getent").chmod(0o755)
    r = run("disaggregated.sh", "--dry-run", "rollout", "/m",
            env={**base, "ROLLOUT_HOST": "internal"}, path_prefix=str(fake))
    assert r.returncode == 0, r.stderr
    assert [f["--host"] for f in server_flags(r.stdout)] == ["10.1.2.3"]
    r = run("disaggregated.sh", "--dry-run", "rollout", "/m",
            env={**base, "ROLLOUT_HOST": "0.0.0.0"})
    assert [f["--host"] for f in server_flags(r.stdout)] == ["0.0.0.0"]
    assert "without SGLANG_API_KEY" in r.stderr
    r = run("disaggregated.sh", "--dry-run", "rollout", "/m",
            env={**base, "ROLLOUT_HOST": "0.0.0.0", "SGLANG_API_KEY": "k"})
    assert r.returncode == 0 and r.stderr == ""


def test_disaggregated_api_key_reaches_servers_and_learner():
    key = "s3cret-key-value"
    env = {"GPUS_PER_NODE": "2", "SGLANG_API_KEY": key}
    r = run("disaggregated.sh", "--dry-run", "rollout", "/m", env=env)
    assert r.returncode == 0, r.stderr
    assert [f["--api-key"] for f in server_flags(r.stdout)] == ["<SGLANG_API_KEY>"] * 2
    assert key not in r.stdout + r.stderr
    r = run("disaggregated.sh", "--dry-run", "learner", "cfg.yaml",
            env={**env, "ROLLOUT_URLS": "http://roll-0:30000"})
    assert r.returncode == 0, r.stderr
    [argv] = argv_lines(r.stdout)
    _, program = split_torchrun(argv)
    assert key not in r.stdout
    cfg = load_config(None, [*overrides_of(program), "model.path=/m"])
    assert cfg.rollout.api_key_env == "SGLANG_API_KEY"
    r = run("colocated.sh", "--dry-run", "cfg.yaml", env=env)
    assert r.returncode == 0, r.stderr
    [argv] = argv_lines(r.stdout)
    _, program = split_torchrun(argv)
    assert load_config(None, [*overrides_of(program), "model.path=/m"]).rollout.api_key_env == \
        "SGLANG_API_KEY"
    assert key not in r.stdout
    r = run("colocated.sh", "--dry-run", "cfg.yaml", env={"GPUS_PER_NODE": "2"})
    assert not any("api_key" in a for a in argv_lines(r.stdout)[0])


def test_disaggregated_dtype_matches_the_learner():
    """Servers get --dtype (SGLang's "auto" serves a float32 checkpoint in float16): the
    learner's model.dtype default, or ROLLOUT_DTYPE for both roles."""
    r = run("disaggregated.sh", "--dry-run", "rollout", "/m", env={"GPUS_PER_NODE": "1"})
    [flags] = server_flags(r.stdout)
    default = load_config(None, ["model.path=/m"]).model.dtype
    assert flags["--dtype"] == default == "bfloat16"
    env = {"GPUS_PER_NODE": "1", "ROLLOUT_DTYPE": "float32"}
    r = run("disaggregated.sh", "--dry-run", "rollout", "/m", env=env)
    assert server_flags(r.stdout)[0]["--dtype"] == "float32"
    r = run("disaggregated.sh", "--dry-run", "learner", "cfg.yaml",
            env={**env, "ROLLOUT_URLS": "http://roll-0:30000"})
    [argv] = argv_lines(r.stdout)
    _, program = split_torchrun(argv)
    assert load_config(None, [*overrides_of(program), "model.path=/m"]).model.dtype == "float32"
    r = run("disaggregated.sh", "--dry-run", "rollout", "/m",
            env={"GPUS_PER_NODE": "1", "ROLLOUT_DTYPE": "fp8"})
    assert r.returncode == 2 and "ROLLOUT_DTYPE" in r.stderr


def test_disaggregated_ports_stay_within_sglangs_bound():
    """SGLang 0.5.12 sets grpc_port = port + 10000 and refuses it above 65535."""
    env = {"GPUS_PER_NODE": "8", "ROLLOUT_BASE_PORT": "55528"}
    r = run("disaggregated.sh", "--dry-run", "rollout", "/m", env=env)
    assert r.returncode == 0, r.stderr
    assert max(int(f["--port"]) for f in server_flags(r.stdout)) == 55535
    r = run("disaggregated.sh", "--dry-run", "rollout", "/m",
            env={**env, "ROLLOUT_BASE_PORT": "55529"})
    assert r.returncode == 2 and "ROLLOUT_BASE_PORT" in r.stderr and r.stdout == ""


def test_disaggregated_rollout_serves_with_api_key_for_real(tmp_path):
    """disaggregated.sh starts a server (the stand-in, which speaks SGLang's HTTP API and its
    --api-key rule) on 127.0.0.1: /health is open, /generate wants the key."""
    import json as _json
    import signal
    import socket
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if port > 55535:
        port = 45000 + port % 10000
    key = "k-123"
    e = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    e.update(GPUS_PER_NODE="1", ROLLOUT_BASE_PORT=str(port), SGLANG_API_KEY=key,
             PYTHON=sys.executable, SGLANG_SERVER_MODULE="megatron_gspo.rollout.standin.server",
             ROLLOUT_DTYPE="float32", PYTHONPATH=str(ROOT), LOG_DIR=str(tmp_path))
    proc = subprocess.Popen(["bash", str(LAUNCH / "disaggregated.sh"), "rollout",
                             str(ROOT / "examples" / "tiny" / "base")], env=e, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def call(path, body=None, auth=None):
        req = urllib.request.Request(base + path, data=None if body is None else
                                     _json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {auth}"}
                                                 if auth else {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as err:
            return err.code

    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if call("/health") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server not healthy in 120 s"
            time.sleep(0.5)
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        assert call("/generate", body) == 401
        assert call("/generate", body, auth="wrong") == 401
        assert call("/generate", body, auth=key) == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


@pytest.fixture
def fake_scontrol(tmp_path):
    """`scontrol show hostnames LIST` for a comma-separated LIST, as SLURM prints it."""
    exe = tmp_path / "scontrol"
    exe.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\n'
                   'echo "$3" | tr , "\\n"\n')
    exe.chmod(0o755)
    return str(tmp_path)


def slurm_env(**extra: str) -> dict[str, str]:
    return {"SLURM_JOB_NODELIST": "gpu-1,gpu-2,gpu-3", "SLURM_JOB_ID": "42",
            "SLURM_SUBMIT_DIR": str(ROOT), "DRY_RUN": "1", **extra}


def test_slurm_colocated(fake_scontrol):
    r = run("slurm.sbatch", "cfg.yaml", "train.seed=7",
            env=slurm_env(IMAGE="registry/megatron-gspo:0.1"), path_prefix=fake_scontrol)
    assert r.returncode == 0, r.stderr
    srun, *nodes = argv_lines(r.stdout)
    assert srun[0] == "srun" and "--nodes=3" in srun and "--nodelist=gpu-1,gpu-2,gpu-3" in srun
    assert "--container-image=registry/megatron-gspo:0.1" in srun
    assert srun[-3:-1] == [str(LAUNCH / "colocated.sh"), "cfg.yaml"]
    assert len(nodes) == 3
    for rank, argv in enumerate(nodes):
        opts, program = split_torchrun(argv)
        assert opts["nnodes"] == "3" and opts["node-rank"] == str(rank)
        assert opts["max-restarts"] == "3" and opts["monitor-interval"] == "5"
        assert opts["master-addr"] == "gpu-1" and opts["log-dir"] == f"{ROOT}/logs/42/node{rank}"
        assert "rollout.colocate=true" in program and program[-1] == "train.seed=7"


def test_slurm_disaggregated(fake_scontrol):
    env = slurm_env(PLACEMENT="disaggregated", ROLLOUT_NODES="1", MODEL_DIR="/models/m",
                    ROLLOUT_TP="2")
    r = run("slurm.sbatch", "cfg.yaml", env=env, path_prefix=fake_scontrol)
    assert r.returncode == 0, r.stderr
    lines = argv_lines(r.stdout)
    srun_roll, *servers = lines[:5]
    assert "--nodelist=gpu-3" in srun_roll and "rollout" in srun_roll
    assert [a[a.index("--port") + 1] for a in servers] == ["30000", "30001", "30002", "30003"]
    srun_learn, *learners = lines[5:]
    assert "--nodelist=gpu-1,gpu-2" in srun_learn and "learner" in srun_learn
    assert len(learners) == 2
    for rank, argv in enumerate(learners):
        opts, program = split_torchrun(argv)
        assert (opts["nnodes"], opts["node-rank"], opts["master-addr"]) == ("2", str(rank), "gpu-1")
        cfg = load_config(None, [*overrides_of(program), "model.path=/m"])
        assert cfg.rollout.server_urls == [f"http://gpu-3:{30000 + i}" for i in range(4)]


def test_slurm_disaggregated_needs_rollout_nodes(fake_scontrol):
    r = run("slurm.sbatch", "cfg.yaml", env=slurm_env(PLACEMENT="disaggregated", MODEL_DIR="/m",
                                                      ROLLOUT_NODES="3"),
            path_prefix=fake_scontrol)
    assert r.returncode == 2 and "ROLLOUT_NODES" in r.stderr


@pytest.mark.slow
def test_two_node_rendezvous_runs_for_real(tmp_path):
    """Two torchrun.sh "nodes" on this machine (2 processes each) meet at MASTER_ADDR and start
    the program with the ranks torchrun assigns; the program is a probe that records them."""
    import socket

    probe = tmp_path / "probe.sh"
    probe.write_text('#!/usr/bin/env bash\n'
                     'echo "$RANK $WORLD_SIZE $LOCAL_RANK $GROUP_RANK $*" '
                     '> "$PROBE_DIR/rank$RANK"\n')
    probe.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    base.update(NNODES="2", GPUS_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHRUN=str(Path(sys.executable).parent / "torchrun"), MEGATRON_GSPO=str(probe),
                PROBE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    (tmp_path / "c.yaml").write_text("train: {}\n")
    procs = [subprocess.Popen(["bash", str(LAUNCH / "torchrun.sh"), "--skip-plan",
                               str(tmp_path / "c.yaml"),
                               "train.seed=3"], env={**base, "NODE_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    seen = sorted((tmp_path / f"rank{r}").read_text().split() for r in range(4))
    # RANK WORLD_SIZE LOCAL_RANK GROUP_RANK(node) then the program's arguments
    assert [row[:4] for row in seen] == [["0", "4", "0", "0"], ["1", "4", "1", "0"],
                                         ["2", "4", "0", "1"], ["3", "4", "1", "1"]]
    assert all(row[4:] == ["train", str(tmp_path / "c.yaml"), "train.seed=3"] for row in seen)


def test_multinode_guide_names_every_launch_variable():
    """Every ROLLOUT_* / SGLANG_* variable the launch scripts read is explained in the guide,
    and the guide says what the servers expose."""
    import re

    used = set()
    for p in SCRIPTS:
        used |= set(re.findall(r"\$\{?((?:ROLLOUT|SGLANG)_[A-Z_]+)", p.read_text()))
    assert {"ROLLOUT_HOST", "ROLLOUT_DTYPE", "SGLANG_API_KEY"} <= used
    guide = (ROOT / "docs" / "multinode.md").read_text()
    assert sorted(v for v in used if v not in guide) == []
    assert "## Security" in guide and "/update_weights_from_tensor" in guide
    assert "55535" in guide
