"""Embedding gradients of Megatron-Core (the project's model builder) and transformers for the
same tokens with the pad token inside the sequence, untied (Qwen3) and tied (Qwen2) embeddings;
prints one JSON line. Run by tests/megatron/test_padding_idx.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PAD = 5


def _logprob_sum(logits, tokens, vocab):
    lp = logits[:, :-1, :vocab].float().log_softmax(-1)  # [1, T-1, V]
    return lp.gather(-1, tokens[:, 1:, None]).sum()


def main(work: Path) -> None:
    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.parallel import ParallelLayout, initialize
    from tests.convert.tiny_models import make_tiny_model

    tokens = torch.tensor([[7, 12, PAD, 30, 41, PAD, 9, 3, 60, 11]])  # [1, T]
    pos = torch.arange(tokens.shape[1])[None]
    out = {}
    for arch in ("Qwen3ForCausalLM", "Qwen2ForCausalLM"):
        hf_dir = work / arch
        hf = make_tiny_model(arch, hf_dir, pad_token_id=PAD)
        vocab = hf.config.vocab_size
        reader = HFCheckpointReader(hf_dir)
        cfg = cio.normalize_hf_config(reader.config)
        adapter = get_adapter(cfg)
        initialize(ParallelLayout(), hf_config=cfg)
        (model,) = cio.build_rank_models(cfg, perform_initialization=False)
        cio.load_hf_weights([model], reader, adapter, adapter.dims(cfg))
        _logprob_sum(model(tokens, pos, attention_mask=None), tokens, vocab).backward()
        mine = model.embedding.word_embeddings.weight.grad[:vocab]  # [V, H]
        _logprob_sum(hf(input_ids=tokens).logits, tokens, vocab).backward()
        want = hf.get_input_embeddings().weight.grad  # [V, H]
        out[arch] = {"max_diff": float((mine - want).abs().max()),
                     "scale": float(want.abs().max()),
                     "pad_row_mine": float(mine[PAD].abs().max()),
                     "pad_row_hf": float(want[PAD].abs().max()),
                     "pad_row_weight": float(hf.get_input_embeddings().weight[PAD].abs().max())}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
