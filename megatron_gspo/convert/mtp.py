"""Multi-token-prediction (MTP) layers of DeepSeek-V3 and GLM-4.5 checkpoints: the HF names
of the released checkpoints (``num_nextn_predict_layers`` layers after the decoder, at layer
index ``num_hidden_layers + k``) and Megatron-Core's `MultiTokenPredictionBlock` names.

DeepSeek-V3 technical report (arXiv 2412.19437, section 2.2), MTP module k:
h'_i = M_k [RMSNorm(h_i^{k-1}); RMSNorm(Emb(t_{i+k}))], then one transformer block, then the
output head shared with the main model. Names, HF ``model.layers.{L}.`` -> Megatron-Core
``mtp.layers.{k}.`` (L = num_hidden_layers + k):

  enorm.weight             [H]      -> enorm.weight          (norm of the next token's embedding)
  hnorm.weight             [H]      -> hnorm.weight          (norm of the previous hidden state)
  eh_proj.weight           [H, 2H]  -> eh_proj.weight        (column-parallel, TP dim 0; input
                                       [enorm(emb); hnorm(h)] in that order in both)
  shared_head.norm.weight  [H]      -> final_layernorm.weight
  a decoder layer (self_attn.*, mlp.*, norms) -> transformer_layer.* (the names of a main
                                       decoder layer of the same kind: MoE when L >= first_k_dense)
  embed_tokens.weight      [V, H]   -> none: Megatron-Core shares the main embedding
  shared_head.head.weight  [V, H]   -> none: Megatron-Core shares the main output layer

The two shared tensors travel with the main embedding / output-layer maps (layout kind
``vocab_shared``): on import each must equal the main tensor (DeepSeek's released weights
store copies), on export the main tensor is written under both names.

transformers builds no MTP layer (``_keys_to_ignore_on_load_unexpected``) and writes
``num_nextn_predict_layers=1`` into every config it saves, with no such tensors: the number of
MTP layers a checkpoint has is read from its tensor names (`present_mtp_layers`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace

from megatron_gspo.convert.param_map import ModelDims, ParamMap

CONFIG_KEY = "num_nextn_predict_layers"
# dense families that ship without MTP layers and get one with `model.mtp_layers: add`
# (`AddedMTPAdapter`); their exports carry it under the DeepSeek-V3 names above
ADDED_MTP_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
# families whose MTP layers are converted and built (tested); others (DeepSeek-V3.2, GLM-5:
# their MTP layer is a sparse-attention layer) keep refusing a checkpoint that has them
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM") + ADDED_MTP_ARCHITECTURES
SPEC_NAMES = ("enorm", "hnorm", "eh_proj", "shared_head.norm")  # SGLang's nextn_spec_weight_names


def declared_mtp_layers(cfg: Mapping) -> int:
    """MTP layers a config.json declares (0 when absent or not an `MTP_ARCHITECTURES` one)."""
    if (cfg.get("architectures") or [None])[0] not in MTP_ARCHITECTURES:
        return 0
    return int(cfg.get(CONFIG_KEY) or 0)


def present_mtp_layers(cfg: Mapping, names: Iterable[str]) -> int:
    """MTP layers of a checkpoint: the declared ones whose ``eh_proj`` tensor exists.

    Args:
        cfg: config.json.
        names: the checkpoint's tensor names.
    Returns:
        count of leading MTP layers present (0 for a transformers-saved checkpoint).
    """
    names = set(names)
    n, layers = 0, int(cfg.get("num_hidden_layers") or 0)
    while n < declared_mtp_layers(cfg) and f"model.layers.{layers + n}.eh_proj.weight" in names:
        n += 1
    return n


def with_present_mtp_layers(cfg: Mapping, names: Iterable[str]) -> dict:
    """Copy of `cfg` whose `CONFIG_KEY` counts the MTP layers the checkpoint really has (left
    as it is when the config declares none or the family is not in `MTP_ARCHITECTURES`)."""
    out = dict(cfg)
    if CONFIG_KEY in out and declared_mtp_layers(cfg):
        out[CONFIG_KEY] = present_mtp_layers(cfg, names)
    return out


def mtp_maps(adapter, dims) -> list[ParamMap]:
    """ParamMaps of the MTP layers' own tensors (`dims.mtp_layers` of them)."""
    H, out = dims.hidden_size, []
    for k in range(getattr(dims, "mtp_layers", 0)):
        L = dims.num_layers + k
        h, m = f"model.layers.{L}.", f"mtp.layers.{k}."
        out += [
            ParamMap(m + "enorm.weight", (h + "enorm.weight",), shapes=((H,),)),
            ParamMap(m + "hnorm.weight", (h + "hnorm.weight",), shapes=((H,),)),
            ParamMap(m + "eh_proj.weight", (h + "eh_proj.weight",), tp_dim=0,
                     shapes=((H, 2 * H),)),
            ParamMap(m + "final_layernorm.weight", (h + "shared_head.norm.weight",),
                     shapes=((H,),)),
        ]
        for pm in adapter.attention_maps(L, dims) + adapter.mlp_maps(L, dims):
            out.append(replace(pm, mcore=pm.mcore.replace(
                f"decoder.layers.{L}.", m + "transformer_layer.", 1)))
    return out


def share_vocab_maps(maps: list[ParamMap], dims) -> list[ParamMap]:
    """`maps` with each MTP layer's ``embed_tokens`` / ``shared_head.head`` added to the main
    embedding / output-layer map (kind ``vocab_shared``)."""
    n = getattr(dims, "mtp_layers", 0)
    if not n:
        return maps
    layers = range(dims.num_layers, dims.num_layers + n)
    emb = tuple(f"model.layers.{L}.embed_tokens.weight" for L in layers)
    head = tuple(f"model.layers.{L}.shared_head.head.weight" for L in layers)
    extra = {"embedding.word_embeddings.weight": emb + (head if dims.tie_embeddings else ()),
             "output_layer.weight": head}
    out = []
    for pm in maps:
        more = extra.get(pm.mcore, ())
        if more:
            pm = replace(pm, hf=pm.hf + more, kind="vocab_shared",
                         shapes=pm.shapes * (1 + len(more)))
        out.append(pm)
    return out


def without_mtp_copies(pm: ParamMap) -> ParamMap:
    """`pm` without the MTP layers' copies (for a model built without its MTP layers)."""
    if pm.kind != "vocab_shared":
        return pm
    return replace(pm, hf=pm.hf[:1], kind="vocab", shapes=pm.shapes[:1])


@dataclass(frozen=True)
class MTPDims(ModelDims):
    """ModelDims of a dense family plus its (added) MTP layers."""

    mtp_layers: int = 0


class AddedMTPAdapter:
    """Mixin for the adapters of `ADDED_MTP_ARCHITECTURES`: a config.json declaring
    `CONFIG_KEY` layers (an export of a run with `model.mtp_layers: add`) maps them as
    DeepSeek-V3's are (`mtp_maps`, `share_vocab_maps`); a config without the key maps as
    before."""

    def dims(self, cfg: Mapping) -> ModelDims:
        base = super().dims(cfg)
        n = declared_mtp_layers(cfg)
        if not n:
            return base
        return MTPDims(**{f.name: getattr(base, f.name) for f in fields(ModelDims)},
                       mtp_layers=n)

    def param_maps(self, dims: ModelDims) -> list[ParamMap]:
        return share_vocab_maps(super().param_maps(dims), dims) + mtp_maps(self, dims)


def is_mtp(name: str) -> bool:
    """A Megatron-Core name of the MTP block."""
    return name.startswith("mtp.")
