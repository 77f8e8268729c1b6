"""Tiny DeepSeek-V3 / GLM-4.5 checkpoints WITH their multi-token-prediction layer, laid out as
the released checkpoints are: ``num_nextn_predict_layers=1`` in config.json and
``model.layers.{num_hidden_layers}.*`` holding a full decoder layer (MoE, as layer index >=
first_k_dense_replace) plus enorm, hnorm, eh_proj, shared_head.norm, and copies of the
embedding (embed_tokens) and output head (shared_head.head).

The MTP layer's decoder tensors are those of an extra last layer of a transformers model built
with one more layer; the MTP-only tensors are random (norms around 1)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.convert.tiny_families import FAMILIES


def make_mtp_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save a tiny `arch` checkpoint with one MTP layer under `out_dir`; returns its tensors."""
    cfg_cls, fields = FAMILIES[arch]
    n = fields["num_hidden_layers"]
    big = dict(fields, num_hidden_layers=n + 1)
    cfg = cfg_cls(**{k: v for k, v in big.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():  # norms and biases away from their init, routers sharp
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    model.save_pretrained(out_dir)  # transformers' on-disk names (per-expert tensors)
    sd = {}
    for f in sorted(out_dir.glob("*.safetensors")):
        sd.update(load_file(f))
        f.unlink()
    for f in out_dir.glob("*.index.json"):
        f.unlink()
    H, g = fields["hidden_size"], torch.Generator().manual_seed(seed + 7)
    p = f"model.layers.{n}."
    sd[p + "enorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    sd[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    sd[p + "eh_proj.weight"] = 0.1 * torch.randn(H, 2 * H, generator=g)
    sd[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[p + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    conf = model.config.to_dict()
    conf.update(num_hidden_layers=n, num_nextn_predict_layers=1, architectures=[arch])
    (out_dir / "config.json").write_text(json.dumps(conf, indent=1))
    (out_dir / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return sd
