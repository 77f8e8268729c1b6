"""Changes that make a memory plan fit (`megatron-gspo plan`, the trainer's start-up check and
the launch scripts' check): each candidate is a setting the user can change (a config override
or the launch's node count), tried by rebuilding the whole plan with it, so a change is named
only when the plan with it fits.

Candidates, cheapest first: the distributed optimizer, offloading the learner while the servers
generate, full recompute, the optimizer state outside the step, a smaller micro-batch, a larger
rollout tensor-parallel size (fewer, larger servers: less weight memory per GPU), another
`rollout.mem_fraction`, learner tensor parallelism, more nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from megatron_gspo.megatron.memory.report import PlanInputs, build_plan

MEM_FRACTIONS = (0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3)


def _divides_heads(x: PlanInputs, tp: int) -> bool:
    d = x.dims
    return d.heads % tp == 0 and (d.kv_heads % tp == 0 or tp % d.kv_heads == 0)


def candidates(x: PlanInputs) -> Iterator[tuple[str, dict]]:
    """(label, PlanInputs fields to replace) of every single change worth trying for `x`."""
    if not x.distributed_optimizer:
        yield "optimizer.distributed_optimizer=true", dict(distributed_optimizer=True)
    if x.colocated_sglang and not x.offload_learner:
        yield "rollout.offload_learner=true", dict(offload_learner=True)
    if not x.recompute:
        yield "model.recompute_activations=true", dict(recompute=True)
    if not x.offload_outside_step:
        yield "optimizer.offload_outside_step=true", dict(offload_outside_step=True)
    mb = x.micro_batch_tokens // 2
    while mb >= max(1, x.kv_tokens_needed):  # a micro-batch holds one whole sequence
        yield f"algorithm.micro_batch_tokens={mb}", dict(micro_batch_tokens=mb)
        mb //= 2
    if x.colocated_sglang:
        tp = x.server_tp * 2
        while tp <= x.gpus_per_node:
            if x.gpus_per_node % tp == 0 and _divides_heads(x, tp):
                yield (f"rollout.tp_size={tp} rollout.num_servers={x.gpus_per_node // tp}",
                       dict(server_tp=tp))
            tp *= 2
        for f in MEM_FRACTIONS:  # the largest that fits: the most KV cache
            if abs(f - x.mem_fraction) > 1e-9:
                yield f"rollout.mem_fraction={f}", dict(mem_fraction=f)
    tp = x.tp * 2
    if (tp <= x.gpus_per_node and x.world % (tp * x.pp * x.cp) == 0
            and _divides_heads(x, tp)):
        yield f"parallel.tensor={tp} parallel.sequence_parallel=true", dict(tp=tp, sp=True)
    nodes = x.world // x.gpus_per_node
    for more in (2 * nodes, 4 * nodes):
        yield f"NNODES={more} (--nodes {more})", dict(world=more * x.gpus_per_node)


def _fits(x: PlanInputs, change: dict) -> bool:
    try:
        return build_plan(dataclasses.replace(x, **change), host=False).fits  # GPU only
    except ValueError:  # e.g. a layout that does not split the new world
        return False


def fitting_changes(x: PlanInputs, limit: int = 6) -> list[str]:
    """The changes checked to make `x` fit, cheapest first: every single one that fits (one
    `rollout.mem_fraction`: the largest that fits), else pairs of them; at most `limit`."""
    singles = list(candidates(x))
    out: list[str] = []
    for label, change in singles:
        if label.startswith("rollout.mem_fraction=") and any(
                o.startswith("rollout.mem_fraction=") for o in out):
            continue
        if _fits(x, change):
            out.append(label)
    if out:
        return out[:limit]
    for i, (la, ca) in enumerate(singles):
        for lb, cb in singles[i + 1:]:
            if set(ca) & set(cb):  # two values of one setting
                continue
            if _fits(x, {**ca, **cb}):
                out.append(f"{la} {lb}")
                if len(out) >= limit:
                    return out
    return out


def describe_changes(changes: list[str]) -> str:
    """One line for a plan that does not fit."""
    if not changes:
        return ("no change checked fits (distributed optimizer, offload, recompute, micro-batch, "
                "rollout TP, mem_fraction, learner TP, 2x / 4x nodes, and pairs of them): more "
                "GPU memory per rank or a smaller model")
    return "changes checked that fit: " + " | ".join(changes)


def check_before_launch(cfg, hf_config: dict, *, gpu_bytes: int | None, world: int,
                        gpus_per_node: int):
    """The trainer's start-up check: None without a GPU size (CPU runs); ConfigError with one
    line naming the first problem, its biggest term and the changes that fit otherwise.

    Returns:
        the `Plan`, or None without a GPU size.
    """
    from megatron_gspo.config import ConfigError
    from megatron_gspo.megatron.memory.report import inputs_from_config

    if gpu_bytes is None:
        return None
    x = inputs_from_config(cfg, hf_config, gpu_bytes=gpu_bytes, gpus_per_node=gpus_per_node,
                           world=world)
    plan = build_plan(x)
    if not plan.fits:
        raise ConfigError(f"memory plan: {plan.problems[0]}; "
                          f"{describe_changes(fitting_changes(x))} "
                          "(megatron-gspo plan CONFIG prints the table)")
    return plan
