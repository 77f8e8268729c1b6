"""The embedded engine's MTP draft head (`rollout.mtp_draft.MTPDraft`) against the learner's
`megatron.models.mtp_block.mtp_logits` on the same tiny DeepSeek-V3 / GLM-4.5 checkpoint with
an MTP layer (tests/convert/tiny_mtp.py); prints one JSON line. Run by
tests/rollout/test_embedded_speculative.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def hf_head_logits(hf_dir: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF-side head over a whole sequence (no cache) and with a cache fed in two chunks:
    (logits [B, S-1, V] without cache, the same with the cache)."""
    from megatron_gspo.rollout.embedded import build_hf_model
    from megatron_gspo.rollout.mtp_draft import MTPDraft, mtp_tensors_in

    target = build_hf_model(str(hf_dir), "float32")
    draft = MTPDraft(target)
    draft.load_named(mtp_tensors_in(hf_dir, draft.layer_index))
    B, S = tokens.shape
    with torch.no_grad():
        h = target.model(input_ids=tokens).last_hidden_state  # [B, S, H] final-normed
        pos = torch.arange(S - 1)[None].expand(B, -1)
        mask = torch.ones(B, S - 1, dtype=torch.long)
        whole = draft.logits(draft(tokens[:, 1:], h[:, :-1], pos, mask))
        from transformers import DynamicCache

        cache, cut = DynamicCache(), 4
        a = draft(tokens[:, 1:cut + 1], h[:, :cut], pos[:, :cut], mask[:, :cut], cache)
        b = draft(tokens[:, cut + 1:], h[:, cut:-1], pos[:, cut:], mask, cache)
        cached = draft.logits(torch.cat([a, b], dim=1))
    return whole, cached


def main(work: Path) -> None:
    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.models.mtp_block import mtp_logits
    from megatron_gspo.megatron.parallel import ParallelLayout, initialize, shutdown
    from tests.convert.tiny_mtp import make_mtp_checkpoint

    out = {}
    for arch in sys.argv[2].split(","):
        hf_dir = work / arch
        make_mtp_checkpoint(arch, hf_dir)
        reader = HFCheckpointReader(hf_dir)
        cfg = cio.normalize_hf_config(reader.config)
        adapter = get_adapter(cfg)
        initialize(ParallelLayout(), hf_config=cfg)
        vocab = cfg["vocab_size"]
        tokens = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(3))
        pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        torch.manual_seed(0)
        (model,) = cio.build_rank_models(cfg, perform_initialization=False, mtp=True)
        cio.load_hf_weights([model], reader, adapter, adapter.dims(cfg))
        model.eval()
        with torch.no_grad():
            (learner,) = mtp_logits(model, tokens, pos)  # [B, S, V_pad]
        learner = learner[:, :-1, :vocab].float()
        whole, cached = hf_head_logits(hf_dir, tokens)
        out[arch] = {"draft_vs_learner": float((whole - learner).abs().max()),
                     "cached_vs_whole": float((cached - whole).abs().max()),
                     "scale": float(learner.abs().max())}
        shutdown()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
