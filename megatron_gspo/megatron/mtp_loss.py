"""The draft-training loss of the multi-token-prediction (MTP) head (`algorithm.mtp_loss_weight`
> 0; issue 58): the head learns online, on the rollout tokens, to predict what the policy
samples, while the policy's gradient stays exactly what it is without the head.

Per packed micro-batch, after the policy forward of `step.forward_step_factory`:

- the decoder's output (final-normed hidden states, [S, B, H], the same tensor
  `models.mtp_block.mtp_logits` and the embedded engine's draft feed the head) and the keyword
  arguments it was called with (rotary embeddings, packed-sequence parameters) are captured by a
  forward hook (`decoder_capture`);
- Megatron-Core's `MultiTokenPredictionBlock` runs on them with every input of the head DETACHED:
  the hidden states, the main embedding's lookup (run under no_grad) and the shared output
  layer's weight; its packed `roll_tensor` shifts tokens within each sequence;
- layer k (1..D) at position i predicts token i + k + 1: cross-entropy against the packed row's
  ``targets[i + k]`` where ``loss_mask[i + k]`` is 1 (the predicted token is a response token)
  and i + k lies in the same sequence; argmax agreement with that sampled token is the accuracy;
- the loss part is ``weight / D * sum_k sum_i CE_k(i) / N`` with N the mini-batch's global
  trainable-token count (the GRPO token-mean divisor), added to the policy loss before
  `step.loss_func`'s ``M * dp`` scaling, so Megatron's averaging gives the same normalisation
  whatever the micro-batching and the data-parallel size.

Since nothing of the head's graph leads back to a policy parameter, every policy gradient is the
one the policy loss alone gives (bit for bit: the sum's backward hands the policy term the same
upstream gradient), and the head's gradient reaches only ``mtp.*`` parameters. The optimizer
keeps them apart too (`make_trainable`): they carry Megatron's ``shared`` attribute, which keeps a
gradient out of the global norm (as for pipeline-shared embeddings), so gradient clipping and the
reported grad_norm are the policy's alone and Adam (per parameter) moves the policy exactly as
without the head; the head's gradient is scaled by the policy's clip coefficient.

How this differs from Megatron-Core's own MTP loss (transformer/multi_token_prediction.py,
0.16.1 and 0.19.2): GPTModel with ``mtp_block_spec`` runs the block inside every forward on the
live hidden states and embedding and ties its loss to them with `MTPLossAutoScaler`, so the MTP
cross-entropy (on ``labels`` rolled by `roll_tensor`, over the whole ``loss_mask``) back-propagates
into the decoder, the embedding and the output layer: an auxiliary pre-training signal for the
trunk. Here the trunk is the RL policy and must not move for the draft's sake: the head's inputs
are detached, its targets are the sampled response tokens only, its weight and metrics are its
own, and the policy forward is untouched.
"""

from __future__ import annotations

import contextlib

import torch

MTP_SUM_KEYS = ("mtp_ce_sum", "mtp_correct", "mtp_count")


class MTPTrainError(ValueError):
    """The MTP loss asked for where it cannot run (one line)."""


def gpt_of(model) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def make_trainable(chunks: list, weight: float) -> int:
    """With `weight` > 0: the MTP parameters of the model chunks require grad (so DDP and the
    optimizer hold them) and carry ``shared`` (out of the global grad norm, module docstring).
    Call before DDP wrapping. Returns the number of parameters made trainable (0 when the
    weight is 0: they stay frozen)."""
    if weight <= 0:
        return 0
    n = 0
    for m in chunks:
        block = getattr(gpt_of(m), "mtp", None)
        for p in block.parameters() if block is not None else ():
            p.requires_grad_(True)
            p.shared = True
            n += 1
    if not n:
        raise MTPTrainError("mtp_loss_weight > 0 needs a model with MTP layers (none built)")
    return n


@contextlib.contextmanager
def decoder_capture(model):
    """Record the decoder's output and call keywords during the model forward inside."""
    seen: dict = {}

    def hook(module, args, kwargs, out):
        seen.update(h=out[0] if isinstance(out, tuple) else out, kwargs=kwargs)

    handle = gpt_of(model).decoder.register_forward_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def head_logits(model, seen: dict, tokens: torch.Tensor,
                position_ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits [B, S, V_pad] of each MTP layer on the captured decoder output, every input of
    the head detached (module docstring).

    Args:
        model: the (wrapped) GPTModel with ``mtp``.
        seen: `decoder_capture`'s record of this forward.
        tokens, position_ids: [B, S] model inputs.
    """
    gpt = gpt_of(model)
    if getattr(gpt, "mtp", None) is None or not gpt.pre_process:
        raise MTPTrainError("the MTP loss needs the MTP layers and the embedding on one stage")
    if gpt.config.tensor_model_parallel_size > 1 or gpt.config.context_parallel_size > 1:
        raise MTPTrainError("the MTP loss under tensor or context parallelism is not supported")
    kw = seen["kwargs"]

    def embed(input_ids, position_ids):  # the main embedding, no gradient into it
        with torch.no_grad():
            return gpt.embedding(input_ids=input_ids, position_ids=position_ids)

    # a detached leaf that requires grad: activation recompute's checkpoint function returns
    # no gradient path when none of its inputs requires grad (its grad is dropped)
    h = seen["h"].detach().requires_grad_(True)
    out = gpt.mtp(input_ids=tokens, position_ids=position_ids, hidden_states=h,
                  attention_mask=kw.get("attention_mask"),
                  rotary_pos_emb=kw.get("rotary_pos_emb"),
                  rotary_pos_cos=kw.get("rotary_pos_cos"),
                  rotary_pos_sin=kw.get("rotary_pos_sin"),
                  packed_seq_params=kw.get("packed_seq_params"),
                  sequence_len_offset=kw.get("sequence_len_offset"), embedding=embed)
    chunks = torch.chunk(out, 1 + len(gpt.mtp.layers), dim=0)[1:]
    tied = gpt.share_embeddings_and_output_weights
    weight = (gpt.shared_embedding_or_output_weight() if tied else gpt.output_layer.weight)
    return [gpt.output_layer(c, weight=weight.detach())[0].transpose(0, 1) for c in chunks]


def sequence_ids(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """[length] index of the packed sequence each position belongs to."""
    pos = torch.arange(length, device=cu_seqlens.device)
    return torch.bucketize(pos, cu_seqlens[1:].long(), right=True)


def mtp_loss(logits: list[torch.Tensor], targets: torch.Tensor, loss_mask: torch.Tensor,
             cu_seqlens: torch.Tensor, *, weight: float, num_tokens: float,
             vocab_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The head's loss part and its summed metrics on one packed row.

    Args:
        logits: per MTP layer [1, S, V_pad] (`head_logits`).
        targets, loss_mask: [S] the row's next tokens and their trainability.
        cu_seqlens: [n + 1] packed sequence boundaries.
        weight: `algorithm.mtp_loss_weight`.
        num_tokens: the global mini-batch's trainable tokens (the divisor).
        vocab_size: true vocabulary (padding columns are not candidates).
    Returns:
        (loss part, {"mtp_ce_sum", "mtp_correct", "mtp_count"} summed over layers).
    """
    S = targets.numel()
    seq = sequence_ids(cu_seqlens, S)
    total = torch.zeros((), dtype=torch.float32, device=targets.device)
    ce_sum, correct, count = total.clone(), total.clone(), total.clone()
    for k, lg in enumerate(logits, start=1):
        if S <= k:
            continue
        x = lg[0, :S - k, :vocab_size].float()  # position i predicts targets[i + k]
        tgt = targets[k:].long().clamp(0, vocab_size - 1)
        m = ((loss_mask[k:] > 0) & (seq[:-k] == seq[k:])).float()
        ce = torch.nn.functional.cross_entropy(x, tgt, reduction="none")
        total = total + (ce * m).sum()
        ce_sum = ce_sum + (ce.detach() * m).sum()
        correct = correct + ((x.detach().argmax(-1) == tgt).float() * m).sum()
        count = count + m.sum()
    part = total * (weight / max(len(logits), 1) / num_tokens)
    return part, {"mtp_ce_sum": ce_sum, "mtp_correct": correct, "mtp_count": count}


def finalize(sums: dict[str, float]) -> dict[str, float]:
    """The logged `mtp/*` metrics from the summed (micro-batch and DP-reduced) counters."""
    n = max(sums["mtp_count"], 1.0)
    return {"mtp/loss": sums["mtp_ce_sum"] / n, "mtp/accuracy": sums["mtp_correct"] / n,
            "mtp/tokens": sums["mtp_count"]}
