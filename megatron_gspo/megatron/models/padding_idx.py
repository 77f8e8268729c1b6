"""transformers' `padding_idx` on Megatron-Core's word embedding: no gradient from the lookups
of the pad token.

Every Hugging Face model class the project converts builds its input embedding as
`nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id)`: the pad token's row is
initialised to zero and its lookups contribute nothing to the embedding's gradient.
Megatron-Core's `VocabParallelEmbedding` has no such index. Without it, a response that
contains the pad token (a policy samples it with a small probability) sends the learner a
gradient through the first RMSNorm of a zero vector, scaled by 1 / sqrt(eps) (1e3 at eps 1e-6):
measured on the long-response MoE, one such token made a mini-batch's gradient norm 3,362
against 0.06-0.24 for the others, all of it in the pad row, and the global clip then shrank
every other weight's update by the same factor.

`keep_pad_row_frozen` adds a forward hook to the embedding that passes the pad positions'
vectors through detached: values unchanged, no gradient from them (the output layer's gradient
of the pad row, when the embeddings are tied, is kept, as in transformers). It works under
tensor parallelism, with and without sequence parallelism (the hook cuts the same sequence
slice Megatron-Core's reduce-scatter hands this rank) and under context parallelism (the
rank's tokens are its input).
"""

from __future__ import annotations

import torch


def keep_pad_row_frozen(embedding: torch.nn.Module, pad_id: int) -> None:
    """Make lookups of `pad_id` in `embedding` (a `VocabParallelEmbedding`) carry no gradient.

    Args:
        embedding: the model's word embedding (`GPTModel.embedding.word_embeddings`).
        pad_id: the HF config's `pad_token_id` (global id).
    """

    def hook(module, args, output):
        if not torch.is_grad_enabled() or not output.requires_grad:
            return output
        mask = args[0] == pad_id  # [b, s] (no host sync on whether any is set)
        if getattr(module, "reduce_scatter_embeddings", False):
            # output [s / tp, b, h]: this rank's contiguous slice of the sequence
            tp = module.tp_group.size()
            mask = mask.transpose(0, 1).chunk(tp, dim=0)[module.tp_group.rank()]  # [s/tp, b]
        return torch.where(mask.unsqueeze(-1), output.detach(), output)

    embedding.register_forward_hook(hook)


def pad_id_of(hf_config: dict, vocab_size: int) -> int | None:
    """The pad token id transformers uses as `padding_idx` (None: unset or out of range)."""
    pad = hf_config.get("pad_token_id")
    if isinstance(pad, list):  # some configs list several; transformers takes an int only
        return None
    if pad is None or not 0 <= int(pad) < vocab_size:
        return None
    return int(pad)
