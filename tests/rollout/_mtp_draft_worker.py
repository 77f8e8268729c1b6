"""The embedded engine's MTP draft head (`rollout.mtp_draft.MTPDraft`) against the learner's
`megatron.models.mtp_block.mtp_logits` on the same tiny DeepSeek-V3 / GLM-4.5 checkpoint with
an MTP layer (tests/convert/tiny_mtp.py) and on the tiny demo (Qwen3) with an added one;
prints one JSON line. Run by
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


def qwen3_with_mtp(out_dir: Path) -> None:
    """The tiny demo (Qwen3, no MTP layer) with a random MTP layer under the names
    `model.mtp_layers: add` exports (a Qwen3 decoder layer plus enorm, hnorm, eh_proj,
    shared_head.norm at layer index num_hidden_layers)."""
    import shutil

    from safetensors.torch import load_file, save_file

    base = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "base"
    shutil.copytree(base, out_dir)
    sd = load_file(str(out_dir / "model.safetensors"))
    cfg = json.loads((out_dir / "config.json").read_text())
    n, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(5)
    for k in [k for k in sd if k.startswith(f"model.layers.{n - 1}.")]:
        sd[k.replace(f"layers.{n - 1}.", f"layers.{n}.")] = sd[k] + 0.02 * torch.randn(
            sd[k].shape, generator=g)
    p = f"model.layers.{n}."
    sd[p + "enorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    sd[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    sd[p + "eh_proj.weight"] = 0.1 * torch.randn(H, 2 * H, generator=g)
    sd[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()  # as exported
    sd[p + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))


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
        if arch == "Qwen3ForCausalLM":
            qwen3_with_mtp(hf_dir)
        else:
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
