"""One pipeline schedule over the policy AND the frozen KL reference.

When a step needs both the learner's own log-probs (pi_old recompute or precision audit) and the
reference's (KL term), both come from one `get_forward_backward_func` call instead of two full
passes over the batch: each model chunk of the policy is paired with the reference chunk of the
same pipeline stage (`PairedChunk`), and every micro-batch runs the policy forward and the
reference forward back to back.

Between pipeline stages the pair travels as one activation of micro-batch size 2,
[s, 2, h] = cat([policy [s, 1, h], reference [s, 1, h]], dim=1), so the schedule's p2p shapes
are those of `micro_batch_size=2` (sequence- and context-parallel splits apply to `s` as usual).
On the last stage each model's logits are reduced to per-token log-probs before the next model
runs, so only one [s, V/tp] logits tensor is alive at a time, as in a single-model pass.
"""

from __future__ import annotations

from functools import partial

import torch

from megatron_gspo.megatron import step


def _unwrapped(model, attr: str):
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model, attr)


class PairedChunk(torch.nn.Module):
    """A policy chunk and the reference chunk of the same stage, run back to back.

    Megatron's schedules find `config`, `model_type` and the decoder through `.module` (the
    policy); `set_input_tensor` splits the received [s, 2, h] activation between the two.

    Args:
        policy: the policy chunk (possibly DDP / Float16Module-wrapped).
        reference: the reference chunk of the same stage and virtual stage.
    """

    def __init__(self, policy: torch.nn.Module, reference: torch.nn.Module):
        super().__init__()
        self.module = policy
        self.reference = reference
        self.last_stage = bool(_unwrapped(policy, "post_process"))

    def set_input_tensor(self, input_tensor) -> None:
        """Give each model its half of the previous stage's [s, 2, h] output (None on the
        first stage)."""
        x = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor
        if x is None:
            mine, ref = None, None
        else:
            if x.dim() != 3 or x.shape[1] != 2:
                raise ValueError(f"paired forward expects a [s, 2, h] activation, got "
                                 f"{tuple(x.shape)}")
            mine, ref = x[:, :1].contiguous(), x[:, 1:].contiguous()  # [s, 1, h] each
        _unwrapped(self.module, "set_input_tensor")([mine])
        _unwrapped(self.reference, "set_input_tensor")([ref])

    def forward(self, *args, last_stage_fn=None, **kwargs):
        """Run the policy, then the reference, on the same inputs.

        Args:
            args / kwargs: the GPTModel inputs (tokens, position ids, mask, packed_seq_params).
            last_stage_fn: on the last stage, maps one model's logits [1, s, V/tp] to what the
                loss function collects (called for the policy before the reference runs).
        Returns:
            [s, 2, h] activations (not last stage), or (policy result, reference result).
        """
        a = self.module(*args, **kwargs)
        if self.last_stage:
            a = last_stage_fn(a)
        b = self.reference(*args, **kwargs)
        if self.last_stage:
            return a, last_stage_fn(b)
        return torch.cat([a, b], dim=1)  # [s, 2, h]


def paired_chunks(policy: list, reference: list) -> list[PairedChunk]:
    """Pair the chunks of two models built in the same layout (one per virtual stage)."""
    if len(policy) != len(reference):
        raise ValueError(f"policy has {len(policy)} model chunks, reference {len(reference)}")
    return [PairedChunk(p, r) for p, r in zip(policy, reference, strict=True)]


def paired_logprob_forward_step_factory(ctx: step.ParallelContext, temperature: float):
    """forward_step_func for a forward-only paired pass; each micro-batch's loss-function
    output holds `logprobs` (policy) and `ref_logprobs` (reference), both [S]."""

    def reduce(data, logits):
        return step.token_logprobs_full(logits, data, ctx, temperature)[0]  # [S]

    def collect(data, output):
        lp, ref_lp = output
        zero = torch.zeros((), device=lp.device)
        return zero, {"logprobs": lp, "ref_logprobs": ref_lp}

    def forward_step(data_iterator, model):
        data = next(data_iterator)
        out = model(data["tokens"], data["position_ids"], None,
                    packed_seq_params=data["packed_seq_params"],
                    last_stage_fn=partial(reduce, data))
        return out, partial(collect, data)

    return forward_step
