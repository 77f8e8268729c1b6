"""SGLang servers of a training run, built from `rollout.*`: attached by URL, or launched
(colocated or not, on one node or on every node of the job), with the weight-sync path the config
resolves to and the launch arguments of the delta loader and the CPU engine.
"""

from __future__ import annotations

import os
import sys

import torch

from megatron_gspo.config import Config, ConfigError
from megatron_gspo.loop import fp8_rollout
from megatron_gspo.loop.early_checks import is_moe

__all__ = ["colocated_on_every_node", "sglang_engine"]


def colocated_on_every_node(cfg: Config) -> bool:
    """True when every node launches its own colocated SGLang servers (`rollout.multinode`):
    launched (no server_urls), colocated, tensor weight sync, on a job of several nodes. Then
    `rollout_engine` is called on every rank (collective)."""
    from megatron_gspo.rollout.multinode.node_servers import nodes_in_job

    r = cfg.rollout
    return (r.engine == "sglang" and r.colocate and not r.server_urls
            and r.weight_sync in ("auto", "tensor") and nodes_in_job() > 1)


def sglang_engine(cfg: Config, default_sampling, log_dir: str | None = None,
                  hf_config: dict | None = None, model_path: str | None = None):
    """SGLang servers from `rollout.*`: attached by URL, or launched (colocated or not).
    `hf_config` (the learner's model config) gives the vocabulary size and the context length
    used when the servers do not report one; `model_path` is the folder launched servers load
    (default model.path)."""
    from megatron_gspo.rollout.sglang.client import SGLangEngine
    from megatron_gspo.rollout.sglang.launch import LaunchSpec
    from megatron_gspo.rollout.sglang.protocol import context_length_of

    r = cfg.rollout
    api_key = None
    if r.api_key_env:
        api_key = os.environ.get(r.api_key_env)
        if not api_key:
            raise ConfigError(f"rollout.api_key_env: environment variable {r.api_key_env} is "
                              "not set or empty")
    sync = r.weight_sync if r.weight_sync != "auto" else ("tensor" if r.colocate else
                                                          "distributed")
    if fp8_rollout.enabled(cfg) and sync == "distributed" and r.sglang_device == "cpu":
        raise ConfigError("rollout.weight_precision: fp8 over rollout.weight_sync=distributed "
                          "with rollout.sglang_device=cpu: gloo (the CPU servers' broadcast) "
                          "cannot broadcast float8_e4m3fn; use rollout.weight_sync=tensor")
    # SGLANG_SERVER_MODULE replaces sglang.launch_server (as in docker/launch/*.sh).
    module = os.environ.get("SGLANG_SERVER_MODULE") or "sglang.launch_server"
    if sync == "tensor" and torch.cuda.is_available():  # CUDA payloads: SGLang's reduction
        from megatron_gspo.rollout.weight_sync_payloads import sglang_importable

        if not sglang_importable():  # CPU tensors travel as shared memory without it
            raise ConfigError("rollout.weight_sync: tensor sync of the learner's CUDA tensors "
                              "needs sglang importable in the learner's environment (its CUDA "
                              "IPC reduction); install it or use weight_sync=distributed")
    master = None
    if sync == "distributed":
        if r.weight_sync_master:
            host, _, port = r.weight_sync_master.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"rollout.weight_sync_master: expected host:port, got "
                                  f"{r.weight_sync_master!r}")
            master = (host, int(port))
        else:
            from megatron_gspo.megatron.parallel import free_port
            from megatron_gspo.rollout.multinode.node_servers import update_master_address

            try:  # MASTER_ADDR, or this node's routable address for servers on other hosts
                host = update_master_address(list(r.server_urls) + (
                    [r.router_url] if r.router_url else []))
            except ValueError as e:
                raise ConfigError(str(e)) from None
            master = (host, free_port())
    # MoE: each token's routed experts (SGLang's return_routed_experts)
    routing = cfg.moe.engine_routing and is_moe(hf_config or {})
    launch = None
    if not r.server_urls:
        if r.weight_sync_delta != "off" and colocated_on_every_node(cfg):
            raise ConfigError("rollout.weight_sync_delta: off with servers on every node")
        runtime = _server_runtime(r)
        if r.speculative.algorithm == "mtp":  # the MTP head drafts (rollout/sglang/speculative)
            runtime["extra"], runtime["env"] = _speculative_runtime(
                r, runtime, model_path or str(cfg.model.path), sync)
        if fp8_rollout.enabled(cfg):  # Blackwell: SGLang's DeepGEMM repacks the scales at load
            runtime["env"] = {**runtime.get("env", {}), **fp8_rollout.server_env()}
        from megatron_gspo.rollout.multinode.node_servers import bind_host

        try:
            host = bind_host(r.host)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        launch = LaunchSpec(model_path=model_path or str(cfg.model.path),
                            num_servers=r.num_servers,
                            tp_size=r.tp_size, host=host, base_port=r.base_port,
                            mem_fraction_static=r.mem_fraction, colocated=r.colocate,
                            seed=cfg.train.seed, dtype=cfg.model.dtype,
                            extra_args=tuple(r.extra_server_args) + (
                                ("--enable-return-routed-experts",) if routing else ()) + (
                                runtime.pop("extra", ())),
                            log_dir=r.server_log_dir or log_dir, api_key=api_key,
                            module=module, deterministic=cfg.train.deterministic, **runtime)
        from megatron_gspo.rollout.sglang.launch import check_local_gpus

        try:
            check_local_gpus(launch, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if launch is not None and colocated_on_every_node(cfg):  # each node launches its own
        from megatron_gspo.rollout.multinode.node_servers import start_node_servers

        if r.launch_router or r.router_url:
            raise ConfigError("rollout.launch_router/router_url: not used with colocated "
                              "servers on several nodes (rank 0's client spreads the requests)")
        return start_node_servers(launch, dict(
            max_concurrency=r.max_concurrency, request_timeout_s=r.request_timeout,
            max_retries=r.max_retries, backoff_s=r.backoff, startup_timeout_s=r.startup_timeout,
            default_sampling=default_sampling, api_key=api_key,
            vocab_size=(hf_config or {}).get("vocab_size"),
            context_length=context_length_of(hf_config) if hf_config else None))
    return SGLangEngine(server_urls=list(r.server_urls) or None, launch=launch,
                        router_url=r.router_url, launch_router=r.launch_router,
                        router_policy=r.router_policy, tp_size=r.tp_size,
                        max_concurrency=r.max_concurrency, request_timeout_s=r.request_timeout,
                        max_retries=r.max_retries, backoff_s=r.backoff,
                        startup_timeout_s=r.startup_timeout, weight_sync=sync,
                        dist_master=master, default_sampling=default_sampling,
                        dist_backend="gloo" if r.sglang_device == "cpu" else "nccl",
                        api_key=api_key, vocab_size=(hf_config or {}).get("vocab_size"),
                        context_length=context_length_of(hf_config) if hf_config else None,
                        return_routing=routing, routing_shape=(
                            int(hf_config["num_hidden_layers"]),
                            int(hf_config["num_experts_per_tok"])) if routing else None)


def _server_runtime(r) -> dict:
    """LaunchSpec fields of `rollout.sglang_python` / `rollout.sglang_device` (the CPU
    engine's environment: `sglang_launch.cpu_server_env`)."""
    from megatron_gspo.rollout.sglang.weight_sync_delta import launch_extras
    from megatron_gspo.rollout.sglang.launch import cpu_server_env

    python = r.sglang_python or sys.executable
    out: dict = {"python": python, "device": r.sglang_device}
    if r.sglang_device == "cpu":
        try:
            out["env"] = cpu_server_env(python)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    out["extra"], out["env"] = launch_extras(out.get("env", {}), r.weight_sync_delta,
                                             r.weight_sync_delta_base)  # the delta loader
    return out


def _speculative_runtime(r, runtime: dict, model_path: str, sync: str) -> tuple:
    """(extra arguments, environment) of launched servers that draft with the MTP head: the
    speculative flags, and on the distributed path the draft link loader (SGLang 0.5.12's
    broadcast skips the draft: `speculative.link_launch_extras`)."""
    import json

    from megatron_gspo.rollout.sglang.speculative import (link_launch_extras,
                                                          speculative_server_args)

    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        arch = str((json.load(f).get("architectures") or ["?"])[0])
    s = r.speculative
    try:
        extra = tuple(runtime.get("extra", ())) + tuple(speculative_server_args(
            arch, s.num_steps, s.topk, s.num_draft_tokens, r.extra_server_args))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    env = runtime.get("env", {})
    return link_launch_extras(extra, env) if sync == "distributed" else (extra, env)
