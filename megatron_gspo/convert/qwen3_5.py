"""State-dict adapters for Qwen3.5 text models: dense (Qwen3_5ForCausalLM, model_type
``qwen3_5_text``) and MoE (Qwen3_5MoeForCausalLM, ``qwen3_5_moe_text``), and the text-only
checkpoint made from a released vision-language one (Qwen3_5ForConditionalGeneration /
Qwen3_5MoeForConditionalGeneration, model_type ``qwen3_5`` / ``qwen3_5_moe``).

The stack is Qwen3-Next's (transformers' `modular_qwen3_5.py` builds on
`modeling_qwen3_next.py`; `convert.qwen3_next` holds the shared maps): gated delta-net and
gated full-attention layers, zero-centred norms, partial rotary. What differs here:
- the delta-net's input projection is four flat tensors, each over all heads in head order:
  ``in_proj_qkv`` [q (nk*dk); k (nk*dk); v (nv*dv)], ``in_proj_z`` [nv*dv], ``in_proj_b`` /
  ``in_proj_a`` [nv] (Qwen3-Next groups them per key head); Megatron-Core's GatedDeltaNet
  ``in_proj`` is [q; k; v; z; beta; alpha] in that order (layout ``gdn_in_flat``: a concat);
- dense Qwen3.5 has a SwiGLU MLP on every layer (no experts); Qwen3.5-MoE has MoE on every
  layer (no ``decoder_sparse_step`` / ``mlp_only_layers`` / ``intermediate_size`` in its config)
  and always renormalises the top-k router weights (no ``norm_topk_prob``);
- rotary is MRoPE (``mrope_section``, ``mrope_interleaved``): with text-only positions its
  three position rows are equal, which is 1-D rotary on the first ``partial_rotary_factor``
  of each head.

Released checkpoints are the vision-language models: config.json nests ``text_config``, tensors
are ``model.language_model.*`` plus a vision tower ``model.visual.*`` and MTP layers ``mtp.*``,
and the MoE experts are fused ``mlp.experts.gate_up_proj`` [E, 2F, H] (gate rows, then up) and
``mlp.experts.down_proj`` [E, H, F]. The learner is text-only: `text_only_checkpoint` writes the
Qwen3_5(Moe)ForCausalLM checkpoint transformers itself loads from them (prefix dropped, vision
tower and MTP layers left out, experts unfused to per-expert tensors, bit-exact slices).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from megatron_gspo.convert.param_map import (
    LAYOUTS,
    ConversionError,
    ModelDims,
    ParamMap,
    StateDictAdapter,
    dims_from_hf_config,
)
from megatron_gspo.convert.qwen3_next import (
    Qwen3NextAdapter,
    Qwen3NextDims,
    layer_types,
    moe_layers,
)

# vision-language architecture -> (text architecture, text model_type)
TEXT_OF = {"Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
           "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")}
REFUSAL = ("config.json architectures=['{arch}'] is the vision-language checkpoint; the learner "
           "is text-only: write its Qwen3.5 text checkpoint first with `python -m "
           "megatron_gspo.convert.qwen3_5 SRC DST` (vision tower and MTP layers left out)")


def _gdn_flat_to_mcore(t, d):
    qkv, z, b, a = t  # [2*nk*dk + nv*dv, H], [nv*dv, H], [nv, H], [nv, H]
    return torch.cat([qkv, z, b, a], dim=0)


def _gdn_flat_to_hf(full, d):
    qk, v = d.lk_heads * d.lk_dim, d.lv_heads * d.lv_dim
    parts = torch.split(full, [2 * qk + v, v, d.lv_heads, d.lv_heads], dim=0)
    return [p.contiguous() for p in parts]


LAYOUTS.update(gdn_in_flat=(_gdn_flat_to_mcore, _gdn_flat_to_hf))


class Qwen3_5Adapter(Qwen3NextAdapter):
    """Qwen3.5 dense: Qwen3-Next's hybrid stack with a dense MLP and flat delta-net inputs."""

    architectures = ("Qwen3_5ForCausalLM",)
    model_types = ("qwen3_5_text",)
    moe = False
    # architectures the registry refuses with this one-line reason (not "unsupported")
    refused = {arch: REFUSAL.format(arch=arch) for arch in TEXT_OF}

    def check_config(self, cfg: Mapping) -> None:
        arch = (cfg.get("architectures") or [None])[0]
        if arch in TEXT_OF:
            raise ConversionError(REFUSAL.format(arch=arch))
        StateDictAdapter.check_config(self, cfg)
        need = ["linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim"]
        need += (["num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size"] if self.moe else ["intermediate_size"])
        for key in need:
            if not cfg.get(key):
                raise ConversionError(f"config.json: missing required field '{key}' "
                                      f"({self.architectures[0]})")
        if not self.moe and cfg.get("num_experts"):
            raise ConversionError("config.json: num_experts is set for Qwen3_5ForCausalLM "
                                  "(the dense model); Qwen3_5MoeForCausalLM has experts")
        if int(cfg["linear_num_value_heads"]) % int(cfg["linear_num_key_heads"]):
            raise ConversionError("config.json: linear_num_value_heads must be a multiple of "
                                  "linear_num_key_heads")

    def dims(self, cfg: Mapping) -> Qwen3NextDims:
        self.check_config(cfg)
        cfg = dict(cfg)
        if self.moe:  # every layer MoE: no dense MLP size, no dense-layer pattern
            cfg.setdefault("intermediate_size", cfg["moe_intermediate_size"])
            for key in ("decoder_sparse_step", "mlp_only_layers"):
                cfg.pop(key, None)
        base = dims_from_hf_config(cfg)
        return Qwen3NextDims(
            **{k: getattr(base, k) for k in ModelDims.__dataclass_fields__},
            linear=tuple(t == "linear_attention" for t in layer_types(cfg)),
            moe=tuple(bool(m) for m in moe_layers(cfg)),
            lk_heads=int(cfg["linear_num_key_heads"]), lv_heads=int(cfg["linear_num_value_heads"]),
            lk_dim=int(cfg["linear_key_head_dim"]), lv_dim=int(cfg["linear_value_head_dim"]),
            conv=int(cfg.get("linear_conv_kernel_dim") or 4),
            shared_ffn=int(cfg.get("shared_expert_intermediate_size") or 0))

    def attention_maps(self, i: int, d: Qwen3NextDims) -> list[ParamMap]:
        maps = super().attention_maps(i, d)
        if not d.linear[i]:
            return maps
        a, s = f"model.layers.{i}.linear_attn.", f"decoder.layers.{i}.self_attention."
        H, qk, v = d.hidden_size, d.lk_heads * d.lk_dim, d.lv_heads * d.lv_dim
        flat = ParamMap(s + "in_proj.weight",
                        tuple(a + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
                        "gdn_in_flat", 0,
                        shapes=((2 * qk + v, H), (v, H), (d.lv_heads, H), (d.lv_heads, H)),
                        sections=(qk, qk, v, v, d.lv_heads, d.lv_heads))
        return [flat if pm.mcore == flat.mcore else pm for pm in maps]


class Qwen3_5MoeAdapter(Qwen3_5Adapter):
    """Qwen3.5-MoE: every layer's MLP is routed experts plus a sigmoid-gated shared expert."""

    architectures = ("Qwen3_5MoeForCausalLM",)
    model_types = ("qwen3_5_moe_text",)
    moe = True


def is_moe_config(cfg: Mapping) -> bool:
    """A Qwen3.5 text config with routed experts."""
    return bool(cfg.get("num_experts"))


# ---------------------------------------------------------------- vision-language -> text


def text_config(cfg: Mapping) -> dict:
    """config.json of the text model inside a Qwen3.5 vision-language config.

    Args:
        cfg: the released config.json (``architectures`` one of `TEXT_OF`).
    Returns:
        a Qwen3_5(Moe)ForCausalLM config.json dict (top-level ``tie_word_embeddings`` kept).
    """
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in TEXT_OF or not isinstance(cfg.get("text_config"), Mapping):
        raise ConversionError(f"config.json architectures={cfg.get('architectures')!r} is not a "
                              f"Qwen3.5 vision-language config with a text_config")
    text_arch, model_type = TEXT_OF[arch]
    out = dict(cfg["text_config"])
    if "tie_word_embeddings" in cfg:
        out["tie_word_embeddings"] = bool(cfg["tie_word_embeddings"])
    out.update(architectures=[text_arch], model_type=model_type)
    return out


def text_tensors(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The text checkpoint's tensors for one released tensor ([] for the vision tower / MTP).

    Fused experts ``gate_up_proj`` [E, 2F, H] -> ``experts.{e}.gate_proj`` / ``up_proj``
    [F, H]; ``down_proj`` [E, H, F] -> ``experts.{e}.down_proj`` [H, F].
    """
    if name.startswith(("model.visual.", "mtp.")):
        return []
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    if name.endswith("mlp.experts.gate_up_proj"):
        base, f = name[: -len("gate_up_proj")], t.shape[1] // 2
        return [(f"{base}{e}.{p}.weight", x[e].contiguous()) for e in range(t.shape[0])
                for p, x in (("gate_proj", t[:, :f]), ("up_proj", t[:, f:]))]
    if name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        return [(f"{base}{e}.down_proj.weight", t[e].contiguous()) for e in range(t.shape[0])]
    return [(name, t)]


def text_only_checkpoint(src: str | Path, dst: str | Path, *, force: bool = False,
                         max_shard_bytes: int = 5 * 2**30) -> dict:
    """Write the Qwen3.5 text checkpoint of a released vision-language one, tensor by tensor
    (size-bounded shards, written to a temporary directory and moved into place when complete).

    Args:
        src: directory of a Qwen3_5(Moe)ForConditionalGeneration safetensors checkpoint.
        dst: directory to create (config.json, shards and index, tokenizer / generation files).
        force: replace an existing `dst`.
        max_shard_bytes: shard size bound.
    Returns:
        counts: {"kept": tensors written, "vision": .., "mtp": .. tensors left out}.
    """
    from megatron_gspo.convert.hf_io import HFCheckpointReader, save_hf_checkpoint

    reader = HFCheckpointReader(src)
    counts = {"kept": 0, "vision": 0, "mtp": 0}

    def items():
        for name in reader.keys():
            if name.startswith(("model.visual.", "mtp.")):
                counts["vision" if name.startswith("model.visual.") else "mtp"] += 1
                continue
            yield from text_tensors(name, reader.get(name))

    try:
        cfg = text_config(reader.config)
        index = save_hf_checkpoint(items(), dst, side_files_from=src, force=force, config=cfg,
                                   max_shard_bytes=max_shard_bytes)
    finally:
        reader.close()
    counts["kept"] = len(index["weight_map"])
    return counts


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_gspo.convert.qwen3_5 SRC DST`: the text checkpoint of SRC."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m megatron_gspo.convert.qwen3_5 SRC DST", file=sys.stderr)
        return 2
    try:
        counts = text_only_checkpoint(*argv)
    except (ConversionError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {argv[1]}: {counts['kept']} tensors; left out {counts['vision']} vision-tower "
          f"and {counts['mtp']} MTP tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())

