"""Launching SGLang servers (and optionally sglang-router) as subprocesses.

Command lines follow SGLang's `python -m sglang.launch_server` flags (server_args.py):
--model-path, --host, --port, --tp-size, --mem-fraction-static, --base-gpu-id,
--random-seed, --dtype, --enable-memory-saver (colocated: lets the server release GPU memory
while the learner trains), --skip-server-warmup, plus free extra arguments. The router follows
`python -m sglang_router.launch_router --worker-urls ... --host --port --policy`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class LaunchSpec:
    """How to launch the SGLang servers of one rollout engine.

    Attributes:
        model_path: HF model directory or hub id the servers load.
        num_servers: servers to launch (each with its own GPUs).
        tp_size: tensor-parallel size of each server.
        host: address to bind (127.0.0.1 unless serving other machines).
        base_port: first port; server i uses the next free port >= base_port + i (0 = any free).
        mem_fraction_static: share of GPU memory for weights + KV cache.
        colocated: the learner shares the GPUs: adds --enable-memory-saver.
        base_gpu_id: first GPU of server 0; server i starts at base_gpu_id + i * tp_size.
        seed: --random-seed.
        dtype: --dtype ("auto", "bfloat16", ...).
        extra_args: appended verbatim to every server command line.
        module: python module to run (SGLang's by default; the stand-in server in tests).
        python: interpreter.
        env: extra environment variables.
        log_dir: where server logs go (None = inherit the parent's stdout/stderr).
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
    dtype: str = "auto"
    extra_args: Sequence[str] = ()
    module: str = "sglang.launch_server"
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"rollout.num_servers must be >= 1, got {self.num_servers}")
        if self.tp_size < 1:
            raise ValueError(f"rollout.tp_size must be >= 1, got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"rollout.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )


def check_local_gpus(spec: LaunchSpec, visible: int) -> None:
    """Fail before launching when the servers need more GPUs than this node has.

    Launched servers run on the node of the process that launches them (the learner's rank 0),
    GPUs base_gpu_id .. base_gpu_id + num_servers * tp_size - 1.

    Args:
        spec: the launch.
        visible: GPUs visible on this node (0 on a machine without CUDA: nothing to check,
            e.g. the CPU stand-in server).
    """
    need = spec.base_gpu_id + spec.num_servers * spec.tp_size
    if visible and need > visible:
        raise ValueError(
            f"rollout.num_servers={spec.num_servers} x rollout.tp_size={spec.tp_size} (from GPU "
            f"{spec.base_gpu_id}) needs {need} GPUs on this node, which has {visible}: launched "
            "servers run on the learner's first node; for rollouts on several nodes start the "
            "servers there and pass rollout.server_urls")


def server_argv(spec: LaunchSpec, index: int, port: int) -> list[str]:
    """The command line of server `index` listening on `port`."""
    argv = [
        spec.python, "-m", spec.module,
        "--model-path", spec.model_path,
        "--host", spec.host,
        "--port", str(port),
        "--tp-size", str(spec.tp_size),
        "--base-gpu-id", str(spec.base_gpu_id + index * spec.tp_size),
        "--random-seed", str(spec.seed + index),
        "--dtype", spec.dtype,
    ]
    if spec.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if spec.colocated:
        argv.append("--enable-memory-saver")
    argv += list(spec.extra_args)
    return argv


def router_argv(
    worker_urls: Sequence[str], host: str, port: int, policy: str = "cache_aware",
    python: str = sys.executable, extra_args: Sequence[str] = (),
) -> list[str]:
    """The sglang-router command line routing over `worker_urls`."""
    return [
        python, "-m", "sglang_router.launch_router",
        "--worker-urls", *worker_urls,
        "--host", host,
        "--port", str(port),
        "--policy", policy,
        *extra_args,
    ]


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def pick_ports(host: str, base: int, count: int, taken: Sequence[int] = ()) -> list[int]:
    """`count` free ports from `base` upward (base 0: ports chosen by the OS)."""
    ports: list[int] = []
    if base == 0:
        while len(ports) < count:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                p = s.getsockname()[1]
            if p not in ports and p not in taken:
                ports.append(p)
        return ports
    p = base
    while len(ports) < count:
        if p > 65535:
            raise RuntimeError(f"no free ports from {base} on {host}")
        if p not in taken and port_is_free(host, p):
            ports.append(p)
        p += 1
    return ports


class ServerProcess:
    """One launched server (or router) process, in its own session so it can be stopped with
    everything it spawned."""

    def __init__(self, argv: list[str], name: str, env: dict[str, str] | None = None,
                 log_path: str | None = None) -> None:
        self.argv, self.name = argv, name
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path else None  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv, env={**os.environ, **(env or {})}, stdout=self._log, stderr=self._log,
            start_new_session=True,
        )

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
        if self._log is not None:
            self._log.close()
            self._log = None

    def describe(self) -> str:
        rc = self.returncode
        state = "running" if rc is None else f"exited with code {rc}"
        log = f" (log: {self.log_path})" if self.log_path else ""
        return f"{self.name} [pid {self.proc.pid}] {state}{log}"
