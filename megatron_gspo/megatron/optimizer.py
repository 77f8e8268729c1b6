"""DDP wrapping, optimizer and LR schedule through megatron.core.

Adam (Megatron's fused Adam when TE / apex provide it, torch Adam otherwise), optional
distributed optimizer (ZeRO-1 style sharded optimizer state), gradient clipping by global norm,
fp32 main parameters for bf16 / fp16 models, and a warmup + cosine / linear / constant LR
schedule (`OptimizerParamScheduler`, stepped once per optimizer step).

Non-finite guard: Megatron's optimizers only look for inf/NaN gradients when a loss scaler is
active (fp16); in fp32 / bf16 a NaN gradient passes gradient clipping (``NaN < 1`` is False) and
Adam writes NaN into every parameter. `grads_finite` + `all_ranks_agree` let the learner skip
such an update on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DECAY_STYLES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class OptimSettings:
    """Optimizer / schedule knobs (one optimizer step per `train_step`).

    The LR follows Megatron's schedule: with `warmup_steps` > 0, optimizer step k (from 0) uses
    lr * k / warmup_steps (so the very first step has lr 0), then decays to `min_lr` at
    `total_steps` ("cosine" / "linear") or stays at `lr` ("constant").
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    total_steps: int = 1000
    decay_style: str = "constant"
    use_distributed_optimizer: bool = False
    mtp_lr: float | None = None  # peak LR of the MTP head's parameters (None: lr)

    def __post_init__(self):
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"optim.decay_style {self.decay_style!r} not in {DECAY_STYLES}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim: need 0 <= min_lr <= lr and lr > 0 (lr={self.lr}, "
                             f"min_lr={self.min_lr})")
        if self.total_steps < 1 or not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(f"optim: need 0 <= warmup_steps ({self.warmup_steps}) < "
                             f"total_steps ({self.total_steps})")


def wrap_ddp(chunks: list, *, use_distributed_optimizer: bool, grad_reduce_in_fp32: bool = True):
    """Wrap model chunks (already Float16Module-wrapped for bf16/fp16) in Megatron DDP.

    Gradients are averaged over DP x CP ranks (`calculate_per_token_loss` stays False; the
    step's loss scaling compensates, see `megatron_gspo.megatron.step`).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        cfg = chunk.config
        wrapped.append(DistributedDataParallel(
            config=cfg, ddp_config=ddp_config, module=chunk,
            # Only the first chunk's buckets may skip the all-reduce start (Megatron convention).
            disable_bucketing=i > 0,
        ))
    return wrapped


def build_optimizer(ddp_chunks: list, settings: OptimSettings, params_dtype: torch.dtype):
    """Megatron optimizer + LR scheduler for the DDP-wrapped chunks.

    Args:
        ddp_chunks: DDP-wrapped model chunks.
        settings: OptimSettings.
        params_dtype: model parameter dtype (bf16/fp16 get fp32 main params).
    Returns:
        (optimizer, scheduler).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        params_dtype=params_dtype,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        loss_scale=None,
    )
    optimizer = get_megatron_optimizer(cfg, ddp_chunks, config_overrides=_mtp_lr(cfg, settings))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=settings.total_steps,
        lr_decay_style=settings.decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=settings.total_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def _mtp_lr(cfg, settings: OptimSettings):
    """Megatron-Core's standard parameter-group overrides (no weight decay on biases and
    norms), plus the MTP head's own peak / floor LR (`megatron.mtp_loss`) when set; None (the
    standard ones) otherwise. The schedule (warmup, decay) is the policy's."""
    if not settings.mtp_lr:
        return None
    from megatron.core.optimizer import ParamKey, get_standard_config_overrides

    overrides = get_standard_config_overrides(cfg)
    overrides[ParamKey(name="*mtp.layers.*")] = {
        "max_lr": settings.mtp_lr, "min_lr": settings.min_lr * settings.mtp_lr / settings.lr}
    return overrides


def grads_finite(ddp_chunks: list) -> bool:
    """True when every gradient this rank holds is finite (Megatron DDP grad buffers; plain
    `.grad` / `.main_grad` of the parameters for other modules)."""
    for chunk in ddp_chunks:
        buffers = getattr(chunk, "buffers", None)
        if isinstance(buffers, list):
            grads = [b.grad_data for b in buffers + list(getattr(chunk, "expert_parallel_buffers",
                                                                  []))]
        else:
            grads = [g for p in chunk.parameters()
                     for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
        if not all(_finite(g) for g in grads):
            return False
    return True


def _finite(g: torch.Tensor) -> bool:
    """Whether every element of `g` is finite, without a temporary of `g`'s size (a bool mask of
    an 8B-parameter gradient buffer is 8 GB; `isfinite` also takes `abs` of it): the minimum and
    maximum come from one reduction, NaN propagates into both, and -inf / +inf are the minimum /
    maximum when present. (A sum could overflow to inf for large finite values.)"""
    if g.numel() == 0:
        return True
    lo, hi = torch.aminmax(g)
    return bool(torch.isfinite(torch.stack([lo, hi])).all())


def all_ranks_agree(flag: bool, device) -> bool:
    """`flag` AND-ed over every rank of the job (one all-reduce; every rank gets the same
    answer, so every rank takes the same skip-or-step decision)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def current_lr(optimizer) -> float:
    """LR of the first parameter group."""
    for group in optimizer.param_groups:
        return float(group["lr"])
    return 0.0
