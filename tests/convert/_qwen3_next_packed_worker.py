"""One process: a tiny Qwen3-Next loaded from HF weights runs a packed row (THD: sequences of
30 and 45 tokens and a 5-token padding tail) the way the learner feeds it; writes the max abs
difference of each sequence's logits from transformers' run of that sequence alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run(hf_dir: str, out: str) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.parallel import ParallelLayout, initialize, shutdown

    refs = torch.load(Path(out).with_name("packed_refs.pt"))
    reader = HFCheckpointReader(hf_dir)
    cfg = cio.normalize_hf_config(reader.config)
    adapter = get_adapter(cfg)
    initialize(ParallelLayout(), hf_config=cfg)
    try:
        (model,) = cio.build_rank_models(cfg, perform_initialization=False)
        cio.load_hf_weights([model], reader, adapter, adapter.dims(cfg))
        model.eval()
        seqs = refs["seqs"]
        lens = [len(s) for s in seqs]
        row = torch.cat(seqs + [torch.zeros(5, dtype=torch.long)]).unsqueeze(0)
        pos = torch.cat([torch.arange(n) for n in lens + [5]]).unsqueeze(0)
        cu = torch.tensor([0, lens[0], sum(lens), sum(lens) + 5], dtype=torch.int32)  # + tail
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=max(lens), max_seqlen_kv=max(lens),
                              cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
        with torch.no_grad():
            logits = model(row, pos, attention_mask=None, packed_seq_params=psp)
        errs, start = [], 0
        for n, want in zip(lens, refs["logits"], strict=True):
            got = logits[0, start:start + n, : want.shape[-1]]
            errs.append(float((got - want).abs().max()))
            start += n
        Path(out).write_text(json.dumps({"errors": errs}))
    finally:
        shutdown()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
