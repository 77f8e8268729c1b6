"""The one place that builds the TP / PP (+virtual) / EP / expert-TP / CP / DP layout.

`ParallelLayout` holds the sizes from the config (`parallel.tensor`, `pipeline`,
`virtual_pipeline`, `expert`, `expert_tensor`, `context`, `sequence_parallel`); data parallel
is derived from the world size. `check_layout` reports every divisibility / combination error at
once, in one message, before anything is built; `initialize` starts torch.distributed (NCCL on
GPU, gloo on CPU, with the CPU compatibility layer) and Megatron's parallel_state.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


# Seconds: a collective of the default group (NCCL's watchdog ends a job whose collective
# outlasts it, torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1), and the waits of ranks 1..N for
# rank 0's rollout, scoring, evaluation, weight push and server start-up, which run on a gloo
# group of their own (`rank0_group`). `configure_timeouts` sets them (config `parallel.timeout`,
# `parallel.rank0_wait_timeout`) before `initialize`.
TIMEOUTS = {"collective": 1800.0, "rank0_wait": 86400.0}
_RANK0_GROUP: list = [None]


def configure_timeouts(collective_s: float, rank0_wait_s: float) -> None:
    """Timeouts of the process groups `initialize` makes next."""
    TIMEOUTS.update(collective=float(collective_s), rank0_wait=float(rank0_wait_s))


def rank0_group():
    """The gloo group over every rank on which ranks wait for rank 0 (None: one process)."""
    return _RANK0_GROUP[0]


def wait_for_rank0() -> None:
    """Every rank waits here until rank 0 arrives, on the gloo group (with its long timeout),
    so that no rank waits in an NCCL collective of the default group meanwhile."""
    if _RANK0_GROUP[0] is not None:
        dist.barrier(group=_RANK0_GROUP[0])


class ParallelLayoutError(ValueError):
    """An impossible parallel layout (sizes that do not divide, unsupported combinations)."""


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel sizes. `expert_tensor=None` means "same as tensor"."""

    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None
    expert: int = 1
    expert_tensor: int | None = None
    context: int = 1
    sequence_parallel: bool = False

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context

    def data_parallel(self, world_size: int) -> int:
        """DP size for `world_size` ranks (call `check_layout` first)."""
        return world_size // self.model_parallel


def check_layout(layout: ParallelLayout, world_size: int, hf_config: dict | None = None) -> int:
    """Validate the layout against the world size (and the model, when given).

    Args:
        layout: parallel sizes.
        world_size: number of ranks.
        hf_config: parsed HF config.json, to check heads / layers / experts / ffn divisibility.
    Returns:
        the data-parallel size.
    Raises:
        ParallelLayoutError listing every problem found.
    """
    errs: list[str] = []
    lay = layout
    for name in ("tensor", "pipeline", "expert", "context"):
        if getattr(lay, name) < 1:
            errs.append(f"parallel.{name}={getattr(lay, name)} must be >= 1")
    if lay.expert_tensor is not None and lay.expert_tensor < 1:
        errs.append(f"parallel.expert_tensor={lay.expert_tensor} must be >= 1")
    if lay.virtual_pipeline is not None and lay.virtual_pipeline < 1:
        errs.append(f"parallel.virtual_pipeline={lay.virtual_pipeline} must be >= 1 or null")
    if errs:
        raise ParallelLayoutError("; ".join(errs))
    mp = lay.model_parallel
    if world_size % mp:
        errs.append(f"world size {world_size} is not divisible by tensor*pipeline*context = "
                    f"{lay.tensor}*{lay.pipeline}*{lay.context} = {mp}")
        dp = 0
    else:
        dp = world_size // mp
    etp = lay.expert_tensor or lay.tensor
    expert_mp = etp * lay.expert * lay.pipeline
    if world_size % expert_mp:
        errs.append(f"world size {world_size} is not divisible by expert_tensor*expert*pipeline"
                    f" = {etp}*{lay.expert}*{lay.pipeline}")
    if lay.virtual_pipeline not in (None, 1) and lay.pipeline < 2:
        errs.append("parallel.virtual_pipeline needs parallel.pipeline >= 2")
    if lay.sequence_parallel and lay.tensor < 2:
        errs.append("parallel.sequence_parallel needs parallel.tensor >= 2")
    if hf_config is not None:
        errs += _model_errors(lay, hf_config)
    if errs:
        raise ParallelLayoutError("invalid parallel layout: " + "; ".join(errs))
    return dp


def _model_errors(lay: ParallelLayout, hf: dict) -> list[str]:
    errs = []
    heads = int(hf.get("num_attention_heads", 0))
    kv = int(hf.get("num_key_value_heads") or heads)
    layers = int(hf.get("num_hidden_layers", 0))
    ffn = hf.get("intermediate_size")
    if heads % lay.tensor:
        errs.append(f"num_attention_heads={heads} not divisible by parallel.tensor={lay.tensor}")
    if kv % lay.tensor:
        errs.append(f"num_key_value_heads={kv} not divisible by parallel.tensor={lay.tensor}")
    if ffn and int(ffn) % lay.tensor:
        errs.append(f"intermediate_size={ffn} not divisible by parallel.tensor={lay.tensor}")
    chunks = lay.pipeline * (lay.virtual_pipeline or 1)
    if layers % chunks:
        errs.append(f"num_hidden_layers={layers} not divisible by pipeline*virtual_pipeline "
                    f"= {chunks}")
    from megatron_gspo.convert.param_map import num_routed_experts

    experts = num_routed_experts(hf) or None
    if experts is not None and lay.tensor > 1 and not lay.sequence_parallel:
        errs.append("an MoE model with parallel.tensor > 1 needs parallel.sequence_parallel=true "
                    "(Megatron-Core requirement)")
    if experts is None and lay.expert > 1:
        errs.append(f"parallel.expert={lay.expert} but the model has no experts")
    if experts is not None and int(experts) % lay.expert:
        errs.append(f"num_experts={experts} not divisible by parallel.expert={lay.expert}")
    moe_ffn = hf.get("moe_intermediate_size")
    etp = lay.expert_tensor or lay.tensor
    if experts is not None and moe_ffn and int(moe_ffn) % etp:
        errs.append(f"moe_intermediate_size={moe_ffn} not divisible by expert tensor size {etp}")
    if experts and etp != lay.tensor and lay.expert == 1:
        errs.append(f"expert tensor size {etp} != parallel.tensor={lay.tensor} needs "
                    "parallel.expert > 1 (with EP 1 Megatron-Core 0.16.1 reduces expert "
                    "gradients as dense ones and misses the other TP ranks' tokens)")
    if experts and etp > 1 and hf.get("architectures") == ["GptOssForCausalLM"]:
        from megatron_gspo.megatron.compat import refusal

        reason = refusal("moe_bias_expert_tensor")
        if reason is not None:
            errs.append(f"gpt-oss experts have biases: {reason} (got {etp}): set "
                        "parallel.expert_tensor=1")
    errs += dsa_layout_errors(hf, lay.tensor)
    if lay.context > 1:
        from megatron_gspo.megatron.fallbacks import te_available

        if not te_available():
            errs.append("parallel.context > 1 needs Transformer Engine attention "
                        "(Megatron-Core's local attention has no context parallelism)")
    return errs


DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")  # models/deepseek_v32.py
DSA_NO_TP = ("{arch} with parallel.tensor > 1 is not supported yet (DeepSeek sparse attention "
             "is measured in one process, under PP2 and EP2; Megatron-Core's "
             "AbsorbedMLASelfAttention also needs sequence parallelism under TP)")


def dsa_layout_errors(hf_config: dict, tensor_parallel: int) -> list[str]:
    """The layouts the DeepSeek sparse attention families refuse (one line each)."""
    arch = (hf_config.get("architectures") or [None])[0]
    if arch in DSA_ARCHITECTURES and tensor_parallel > 1:
        return [DSA_NO_TP.format(arch=arch)]
    return []


def initialize(layout: ParallelLayout, *, seed: int = 1234, timeout_s: float | None = None,
               hf_config: dict | None = None) -> int:
    """Start torch.distributed (from torchrun env vars) and Megatron parallel_state.

    On a CPU-only machine this activates `megatron_gspo.megatron.cpu` and uses gloo; on GPU
    it binds LOCAL_RANK's device and uses NCCL. Single-process use works without torchrun
    (MASTER_ADDR/PORT default to 127.0.0.1 and a free port).

    Args:
        layout: parallel sizes.
        seed: base seed for Megatron's RNG tracker (TP-aware).
        timeout_s: collective timeout of the default group (default TIMEOUTS["collective"]);
            the rank-0 wait group gets TIMEOUTS["rank0_wait"].
        hf_config: checked against the layout before anything is built.
    Returns:
        the data-parallel size.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_gspo.megatron import cpu

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = check_layout(layout, world, hf_config)
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        cpu.enable()
    if not dist.is_initialized():
        if world == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            if "TORCHELASTIC_RUN_ID" not in os.environ:  # not torchrun's: a port free now (an
                os.environ["MASTER_PORT"] = str(free_port())  # inherited one may be taken)
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("LOCAL_RANK", "0")
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=timeout_s or TIMEOUTS["collective"])
        dist.init_process_group(backend="nccl" if on_gpu else "gloo", world_size=world,
                                rank=int(os.environ.get("RANK", "0")), timeout=timeout,
                                store=restart_round_store(world, timeout))
    elif dist.get_world_size() != world:
        world = dist.get_world_size()
        dp = check_layout(layout, world, hf_config)
    if _RANK0_GROUP[0] is None and dist.get_world_size() > 1:
        _RANK0_GROUP[0] = dist.new_group(backend="gloo", timeout=datetime.timedelta(
            seconds=TIMEOUTS["rank0_wait"]))
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        virtual_pipeline_model_parallel_size=(
            layout.virtual_pipeline if (layout.virtual_pipeline or 1) > 1 else None),
        context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return dp


def restart_round_store(world: int, timeout: datetime.timedelta):
    """The store of this torchrun restart round, or None (then `env://` as usual).

    torchrun's elastic agent keeps one TCPStore for the whole job and hands it to every worker
    group it starts (TORCHELASTIC_USE_AGENT_STORE=True), without a per-round prefix: after a
    `--max-restarts` restart the new workers read the dead group's keys (gloo's rank
    addresses, the NCCL unique id, barrier counters) and fail ("Gloo connectFullMesh failed ...
    Connection refused") or hang (pytorch/pytorch#135712). Every round's keys go under
    `megatron_gspo/round_<TORCHELASTIC_RESTART_COUNT>/`. The count is kept by each node's agent:
    it is the same on every node with static rendezvous (`docker/launch/torchrun.sh`) and on one
    node; elastic multi-node c10d runs set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store
    on a fresh port every round, see docs/multinode.md).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or world == 1:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=world, is_master=False, timeout=timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megatron_gspo/round_{restart}", store)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    """Destroy parallel_state and the process group (if started)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _RANK0_GROUP[0] = None
    if dist.is_initialized():
        dist.destroy_process_group()
