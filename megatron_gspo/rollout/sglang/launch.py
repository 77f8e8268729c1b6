"""Launching SGLang servers (and optionally sglang-router) as subprocesses.

Command lines follow SGLang's `python -m sglang.launch_server` flags (server_args.py):
--model-path, --host, --port, --tp-size, --mem-fraction-static, --base-gpu-id,
--random-seed, --dtype, --enable-memory-saver (colocated: lets the server release GPU memory
while the learner trains), --api-key (when one is configured), plus free extra arguments
(e.g. --skip-server-warmup, which is not passed by default). The router follows
`python -m sglang_router.launch_router --worker-urls ... --host --port --policy [--api-key]`.

Launched servers get `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`: in SGLang 0.5.12 `/health`
otherwise runs a one-token generation, also on a server whose memory is released, and the
router polls `/health` (see `sglang_protocol`). Ports stay at most 55535 (SGLang refuses a
port whose port + 10000 is above 65535). The API key never appears in logged command lines.
Every server gets the launch's token as `--served-model-name` (`LaunchSpec.run_token`), and
its ports are held from the pick to its end (`ports.PortHold`): two jobs on one machine never
drive each other's servers.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_gspo.runtime import exec_with_parent, server_record
from megatron_gspo.rollout.sglang.ports import TOKEN_FLAG, PortHold, new_run_token
from megatron_gspo.rollout.sglang.protocol import HEALTH_GENERATION_ENV, MAX_SERVER_PORT

log = logging.getLogger(__name__)

#: --dtype values a launched server gets (the learner's export dtypes; never "auto").
SERVER_DTYPES = ("float32", "bfloat16", "float16")
#: --max-total-tokens of a CPU-engine server unless its extra arguments give one.
CPU_MAX_TOTAL_TOKENS = 8192


@dataclass
class LaunchSpec:
    """How to launch the SGLang servers of one rollout engine.

    Attributes:
        model_path: HF model directory or hub id the servers load.
        num_servers: servers to launch (each with its own GPUs).
        tp_size: tensor-parallel size of each server.
        host: address to bind (127.0.0.1 unless serving other machines).
        base_port: first port; server i uses the next free port >= base_port + i (0 = any free);
            at most 55535 (SGLang's port rule).
        mem_fraction_static: share of GPU memory for weights + KV cache.
        colocated: the learner shares the GPUs: adds --enable-memory-saver.
        base_gpu_id: first GPU of server 0; server i starts at base_gpu_id + i * tp_size.
        seed: --random-seed.
        dtype: --dtype: the dtype the learner exports ("float32", "bfloat16", "float16");
            "auto" is refused (SGLang serves a float32 checkpoint as float16 under it).
        extra_args: appended verbatim to every server command line.
        module: python module to run (SGLang's by default; the stand-in server in tests).
        python: interpreter.
        device: "cuda", or "cpu" for SGLang's CPU engine (`cpu_server_args`, `cpu_server_env`).
        env: extra environment variables.
        log_dir: where server logs go (None = inherit the parent's stdout/stderr).
        api_key: SGLang --api-key of every server (None = none); kept out of repr.
        deterministic: --enable-deterministic-inference (a request's `sampling_seed` then
            seeds its sampling; batch-invariant kernels). Not on the CPU engine: upstream's
            deterministic mode needs fa3, flashinfer or triton attention
            (server_args.py `_handle_deterministic_inference`), which the CPU engine lacks.
        run_token: this launch's identity, passed as `--served-model-name` and checked in each
            server's /server_info before anything else is sent (`ports`); new per spec.
    """

    model_path: str
    num_servers: int = 1
    tp_size: int = 1
    host: str = "127.0.0.1"
    base_port: int = 30000
    mem_fraction_static: float | None = None
    colocated: bool = False
    base_gpu_id: int = 0
    seed: int = 0
    dtype: str = "bfloat16"
    extra_args: Sequence[str] = ()
    module: str = "sglang.launch_server"
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    api_key: str | None = field(default=None, repr=False)
    device: str = "cuda"
    deterministic: bool = False
    run_token: str = field(default_factory=new_run_token)

    def __post_init__(self) -> None:
        if any(a.split("=", 1)[0] == TOKEN_FLAG for a in self.extra_args):
            raise ValueError(f"rollout.extra_server_args: {TOKEN_FLAG} is taken: the launcher "
                             "passes the run's token in it, checked in each server's "
                             "/server_info so that no job drives another job's server")
        if self.dtype not in SERVER_DTYPES:
            raise ValueError(
                f"rollout server dtype must be the learner's export dtype, one of "
                f"{list(SERVER_DTYPES)}, got {self.dtype!r} (SGLang's --dtype auto serves a "
                "float32 checkpoint as float16)")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"rollout.sglang_device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.num_servers < 1:
            raise ValueError(f"rollout.num_servers must be >= 1, got {self.num_servers}")
        if self.tp_size < 1:
            raise ValueError(f"rollout.tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.base_port <= MAX_SERVER_PORT:
            raise ValueError(f"rollout.base_port must be in [0, {MAX_SERVER_PORT}] (0: any free "
                             f"port; SGLang adds 10000 for its gRPC port), got {self.base_port}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"rollout.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )
        if self.deterministic and self.device == "cpu":
            log.warning("train.deterministic: SGLang's CPU engine has no deterministic inference "
                        "(it needs fa3, flashinfer or triton attention); its sampling does not "
                        "follow the per-sample seeds")


def check_local_gpus(spec: LaunchSpec, visible: int) -> None:
    """Fail before launching when the servers need more GPUs than this node has.

    Launched servers run on the node of the process that launches them (the learner's rank 0;
    with colocated servers on several nodes, every node's first rank launches num_servers on its
    own node), GPUs base_gpu_id .. base_gpu_id + num_servers * tp_size - 1.

    Args:
        spec: the launch.
        visible: GPUs visible on this node (0 on a machine without CUDA: nothing to check,
            e.g. the CPU stand-in server).
    """
    need = spec.base_gpu_id + spec.num_servers * spec.tp_size
    if visible and need > visible:
        raise ValueError(
            f"rollout.num_servers={spec.num_servers} x rollout.tp_size={spec.tp_size} (from GPU "
            f"{spec.base_gpu_id}) needs {need} GPUs on this node, which has {visible}: "
            "rollout.num_servers counts the servers of one node (colocated with tensor weight "
            "sync: on every node of the job; otherwise on the learner's first node)")


def server_argv(spec: LaunchSpec, index: int, port: int, dist_port: int | None = None) -> list[str]:
    """The command line of server `index` listening on `port`; `dist_port` (`--nccl-port`,
    unless `extra_args` names one) is its torch.distributed store's port (`pick_dist_port`)."""
    argv = [
        spec.python, "-m", spec.module,
        "--model-path", spec.model_path,
        "--host", spec.host,
        "--port", str(port),
        "--tp-size", str(spec.tp_size),
        "--base-gpu-id", str(spec.base_gpu_id + index * spec.tp_size),
        "--random-seed", str(spec.seed + index),
        "--dtype", spec.dtype,
        TOKEN_FLAG, spec.run_token,
    ]
    if spec.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if spec.colocated and spec.device != "cpu":  # torch_memory_saver needs CUDA
        argv.append("--enable-memory-saver")
    if spec.api_key:
        argv += ["--api-key", spec.api_key]
    if spec.deterministic and spec.device != "cpu":
        argv.append("--enable-deterministic-inference")
    if dist_port is not None and "--nccl-port" not in spec.extra_args:
        argv += ["--nccl-port", str(dist_port)]
    if spec.device == "cpu":
        argv += cpu_server_args(spec.extra_args)
    argv += list(spec.extra_args)
    return argv


def cpu_server_args(extra_args: Sequence[str] = ()) -> list[str]:
    """Flags of SGLang's CPU engine (measured with 0.5.12 on x86-64 without AMX): no overlap
    schedule and no CUDA graphs, torch_native attention, and a KV pool of CPU_MAX_TOTAL_TOKENS
    tokens unless `extra_args` sizes it (without a bound the pool takes a share of host memory).
    """
    argv = ["--device", "cpu", "--disable-overlap-schedule", "--disable-cuda-graph",
            "--attention-backend", "torch_native"]
    if "--max-total-tokens" not in extra_args:
        argv += ["--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]
    return argv


def cpu_server_env(python: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a CPU-engine server: SGLANG_USE_CPU_ENGINE=1 and the no-GPU driver stub
    of `python`'s install on LD_LIBRARY_PATH. scripts/sglang_cpu.sh lays an install out as
    DIR/venv/bin/python and DIR/stub/libcuda.so.1 (sglang-kernel's CUDA libraries need a
    libcuda.so.1 to load; the CPU engine calls none of their CUDA ops).

    Raises:
        ValueError: no stub next to `python`'s venv.
    """
    base = os.environ if base is None else base
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    stub = os.path.join(os.path.dirname(venv), "stub")
    if not os.path.isfile(os.path.join(stub, "libcuda.so.1")):
        raise ValueError(
            f"rollout.sglang_device=cpu: no {stub}/libcuda.so.1 next to the venv of {python} "
            "(install the CPU server with scripts/sglang_cpu.sh and set rollout.sglang_python "
            "to its DIR/venv/bin/python)")
    old = base.get("LD_LIBRARY_PATH")
    return {"SGLANG_USE_CPU_ENGINE": "1",
            "LD_LIBRARY_PATH": stub + (os.pathsep + old if old else "")}


def server_env(spec: LaunchSpec) -> dict[str, str]:
    """Extra environment of a launched server: /health without a generation, then spec.env."""
    return {HEALTH_GENERATION_ENV: "0", **spec.env}


# What torchrun (torch/distributed/elastic/agent/server/local_elastic_agent.py) and the image
# set for the learner's workers, which no launched server may inherit: with
# TORCHELASTIC_USE_AGENT_STORE=True torch's tcp:// rendezvous makes every rank a store client
# (torch/distributed/rendezvous.py `_create_c10d_store`), so a server's own TP group never
# forms; RANK / WORLD_SIZE / MASTER_* describe the learner's job, not the server's;
# CUDA_DEVICE_MAX_CONNECTIONS=1 is Megatron's setting and serialises a server's kernels.
LEARNER_ONLY_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                    "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                    "CUDA_DEVICE_MAX_CONNECTIONS")
LEARNER_ONLY_ENV_PREFIXES = ("TORCHELASTIC_",)


def launch_environ(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a launched process (server, router) starts from: `base` (default
    os.environ) without the learner-only variables (`LEARNER_ONLY_ENV`, TORCHELASTIC_*)."""
    base = os.environ if base is None else base
    return {k: v for k, v in base.items()
            if k not in LEARNER_ONLY_ENV and not k.startswith(LEARNER_ONLY_ENV_PREFIXES)}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """`argv` with the value after --api-key replaced, for logs."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--api-key":
            out[i + 1] = "***"
    return out


def router_argv(
    worker_urls: Sequence[str], host: str, port: int, policy: str = "cache_aware",
    python: str = sys.executable, extra_args: Sequence[str] = (), api_key: str | None = None,
    module: str = "sglang_router.launch_router",
) -> list[str]:
    """The sglang-router command line routing over `worker_urls` (api_key: sent to workers)."""
    argv = [
        python, "-m", module,
        "--worker-urls", *worker_urls,
        "--host", host,
        "--port", str(port),
        "--policy", policy,
    ]
    if api_key:
        argv += ["--api-key", api_key]
    return argv + list(extra_args)


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


#: where `pick_dist_port` looks: under the kernel's ephemeral range (32768 up by default)
DIST_PORT_RANGE = (22000, 29999)


def pick_dist_port(taken: Sequence[int] = (), rng: random.Random | None = None,
                   attempts: int = 256, hold: PortHold | None = None) -> int:
    """A free port for a launched server's torch.distributed store (`--nccl-port`), under the
    kernel's ephemeral range. Left to itself, SGLang 0.5.12 takes a bind(0) port
    (`get_free_port()` in server_args.py `PortArgs.init_new`): an ephemeral one, which an
    outgoing connection (gloo, NCCL, HTTP) can take in the seconds before the scheduler's
    TCPStore binds it, and the server then fails to start with EADDRINUSE (seen with two jobs
    on one machine). 0.5.23 picks under the ephemeral range itself
    (`get_free_port_below_ephemeral()`, srt/utils/network.py); passing the port gives both
    releases that, and keeps the servers of one launch on distinct ports.

    Args:
        taken: ports not to hand out (the servers' own, earlier picks).
        rng: randomness of the pick (default: the `random` module's).
        hold: takes the port (`ports.PortHold`; one held elsewhere is not picked).
    Returns:
        a port free on every IPv4 address at the time of the pick.
    """
    low, high = DIST_PORT_RANGE
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = min(high, int(f.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    skip = set(taken)
    pool = [p for p in range(low, high + 1) if p not in skip]
    for p in (rng or random).sample(pool, min(attempts, len(pool))):
        if port_is_free("0.0.0.0", p) and (hold is None or hold.take(p)):
            return p
    return pick_ports("127.0.0.1", 0, 1, taken=taken, hold=hold)[0]


def pick_ports(host: str, base: int, count: int, taken: Sequence[int] = (),
               limit: int = MAX_SERVER_PORT, hold: PortHold | None = None) -> list[int]:
    """`count` free ports from `base` upward (base 0: ports chosen by the OS), none above
    `limit` (SGLang refuses server ports above 55535). With `hold` (`ports.PortHold`) each
    port is held from the pick on, and a port another job holds is skipped: a port is free
    when it is picked, but the server binds it seconds later."""
    ports: list[int] = []

    def ok(p: int) -> bool:
        return p not in ports and p not in taken and (hold is None or hold.take(p))

    if base == 0:
        for _ in range(1000 * count):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                p = s.getsockname()[1]
            if p <= limit and ok(p):
                ports.append(p)
            if len(ports) == count:
                return ports
        raise RuntimeError(f"the OS gave no free port at most {limit} on {host}")
    p = base
    while len(ports) < count:
        if p > limit:
            raise RuntimeError(f"only {len(ports)} of {count} free ports from {base} to {limit} "
                               f"on {host} (SGLang refuses ports above {MAX_SERVER_PORT})")
        if p not in taken and port_is_free(host, p) and ok(p):
            ports.append(p)
        p += 1
    return ports


def argv_gpus(argv: Sequence[str]) -> list[int]:
    """GPUs of a server command line (--base-gpu-id, --tp-size); [] for one without them."""
    def flag(name: str) -> int | None:
        return int(argv[argv.index(name) + 1]) if name in argv[:-1] else None

    base = flag("--base-gpu-id")
    return [] if base is None else list(range(base, base + (flag("--tp-size") or 1)))


class ServerProcess:
    """One launched server (or router) process, in its own session so it can be stopped with
    everything it spawned. In a torchrun round after a restart, the first one starts once the
    dead round's servers are gone and their GPU memory is back (`runtime.server_record`)."""

    def __init__(self, argv: list[str], name: str, env: dict[str, str] | None = None,
                 log_path: str | None = None) -> None:
        self.argv, self.name = argv, name
        self.log_path = log_path
        waited = server_record.before_launch()
        if waited:
            log.info("waited %.1f s for the previous round's servers to end", waited)
        self._log = open(log_path, "ab") if log_path else None  # noqa: SIM115
        self.proc = subprocess.Popen(  # ends with this process, also on SIGKILL
            exec_with_parent.wrap(argv), env={**launch_environ(), **(env or {})}, stdout=self._log,
            stderr=self._log, start_new_session=True,
        )
        server_record.add(self.proc.pid, argv_gpus(argv), name)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL it."""
        if self.alive():
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait
                while self.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not self.alive():
                    break
        self.proc.poll()
        if self.proc.returncode is not None:
            server_record.forget(self.proc.pid)
        if self._log is not None:
            self._log.close()
            self._log = None

    def describe(self) -> str:
        rc = self.returncode
        state = "running" if rc is None else f"exited with code {rc}"
        log = f" (log: {self.log_path})" if self.log_path else ""
        return f"{self.name} [pid {self.proc.pid}] {state}{log}"
