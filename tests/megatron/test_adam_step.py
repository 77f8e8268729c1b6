"""Adam's step count survives a checkpoint wherever the optimizer keeps it: torch's AdamW per
parameter (the CPU path), Transformer Engine's FusedAdam in `param_group["step"]` (the GPU
path). The stand-in below keeps its step the way TransformerEngine v2.11's
transformer_engine/pytorch/optimizers/fused_adam.py does (`FusedAdam.step`: group["step"] += 1,
or = 1 on the first step; nothing per parameter; empty groups are skipped)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_gspo.megatron import adam_step
from megatron_gspo.megatron.learner_state import LearnerState


class FusedAdamStandIn(torch.optim.Optimizer):
    """Plain Adam whose step count lives in the param group, as in TE's FusedAdam."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr, betas=(0.9, 0.999), eps=1e-8))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            b1, b2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m = st["exp_avg"] / (1 - b1 ** group["step"])
                v = st["exp_avg_sq"] / (1 - b2 ** group["step"])
                p.sub_(group["lr"] * m / (v.sqrt() + group["eps"]))


class _Learner(LearnerState):
    """The checkpoint methods of the learner, around an optimizer only."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def _megatron_like(inner):
    """What LearnerState sees: a chained Megatron optimizer around one inner optimizer."""
    return SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])


def _stepped(cls, steps: int):
    p = torch.nn.Parameter(torch.ones(3))
    opt = cls([{"params": [p]}, {"params": []}])  # an empty group, as Megatron makes
    for _ in range(steps):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    return opt


def test_fused_adam_step_is_read_from_the_param_group():
    opt = _megatron_like(_stepped(FusedAdamStandIn, 3))
    assert not any("step" in st for st in opt.chained_optimizers[0].optimizer.state.values())
    assert _Learner(opt)._adam_step() == 3.0


def test_fused_adam_step_is_restored_into_the_param_group():
    """After a load the reshardable format leaves the dummy step 1: the saved count goes back
    into the param group (the empty group stays without one, as TE leaves it)."""
    inner = _stepped(FusedAdamStandIn, 1)
    learner = _Learner(_megatron_like(inner))
    learner._restore_adam_step(40.0)
    assert inner.param_groups[0]["step"] == 40 and isinstance(inner.param_groups[0]["step"], int)
    assert "step" not in inner.param_groups[1]
    assert learner._adam_step() == 40.0


def test_torch_adamw_step_is_read_and_restored_per_parameter():
    inner = _stepped(torch.optim.AdamW, 2)
    learner = _Learner(_megatron_like(inner))
    assert learner._adam_step() == 2.0
    learner._restore_adam_step(9.0)
    [st] = inner.state.values()
    assert isinstance(st["step"], torch.Tensor) and float(st["step"]) == 9.0
    assert adam_step.read(learner.optimizer) == 9.0


def test_no_step_before_the_first_update():
    assert adam_step.read(_megatron_like(_stepped(FusedAdamStandIn, 0))) is None
    assert adam_step.restore(_megatron_like(_stepped(FusedAdamStandIn, 0)), 5) == 0
