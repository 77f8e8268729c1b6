"""Name and layout mapping between Hugging Face and Megatron-Core GPTModel state dicts.

The mapping is expressed once, as a list of `ParamMap` entries per model: each entry ties one
Megatron-Core parameter (named as in the local layer spec, with global layer and expert indices)
to the Hugging Face tensors it is made of, plus a layout `kind`:

- ``copy``:  same tensor under another name (norms, output projections, router, ...).
- ``qkv``:   q/k/v projections fused into ``linear_qkv`` with per-query-group interleaving:
             for each of the ``num_query_groups`` groups, rows ``[q heads of the group, k, v]``.
             The same layout holds for the bias (``qkv_bias``).
- ``glu``:   gate and up projections fused into ``linear_fc1`` as ``[gate; up]``.
- ``vocab``: embedding / output layer rows, zero-padded to the padded vocabulary size.

The Transformer Engine spec fuses the pre-attention / pre-MLP norms into the following linear
layer and stores grouped experts as ``experts.linear_fc1.weight{e}``; `to_te_name` and
`from_te_name` translate between the two spellings, so one mapping serves both specs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from megatron_gspo.convert.fused_experts import (
    SLICE_KINDS,
    ExpertSlices,
    slice_to_hf,
    slice_to_mcore,
)
from megatron_gspo.convert.te_names import from_te_name, to_te_name  # noqa: F401 (re-exported)

GLU_KINDS = ("glu", "fused_fc1", "fused_fc1_bias")  # [gate; up] in Megatron: split per half
VOCAB_KINDS = ("vocab", "vocab_shared")  # vocab_shared: more HF copies (MTP, convert.mtp)
KINDS = ("copy", "qkv", "qkv_bias", "glu", *VOCAB_KINDS, *SLICE_KINDS)
# family-specific layouts: kind -> (to_mcore(tensors, dims), to_hf(full, dims) -> tensors),
# registered by the adapter module that uses them (convert/qwen3_next.py)
LAYOUTS: dict[str, tuple[Callable, Callable]] = {}


class ConversionError(ValueError):
    """A checkpoint or config cannot be converted; the message names the offending item."""


@dataclass(frozen=True)
class ModelDims:
    """Shapes that decide tensor layouts, read from a Hugging Face config.json."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _req(cfg: Mapping, key: str):
    if key not in cfg or cfg[key] is None:
        raise ConversionError(f"config.json: missing required field '{key}'")
    return cfg[key]


def num_routed_experts(cfg: Mapping) -> int:
    """Routed experts per MoE layer of an HF config (0 = dense): ``num_experts`` (Qwen3-MoE),
    ``num_local_experts`` (transformers 5, gpt-oss) or ``n_routed_experts`` (DeepSeek, GLM)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts")
               or cfg.get("n_routed_experts") or 0)


def dims_from_hf_config(cfg: Mapping) -> ModelDims:
    """Read layout-relevant sizes from a Hugging Face config dict.

    Args:
        cfg: parsed config.json.
    Returns:
        ModelDims; raises ConversionError naming a missing or inconsistent field.
    """
    hidden = int(_req(cfg, "hidden_size"))
    heads = int(_req(cfg, "num_attention_heads"))
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv:
        raise ConversionError(
            f"config.json: num_attention_heads={heads} not divisible by num_key_value_heads={kv}"
        )
    experts = num_routed_experts(cfg)
    return ModelDims(
        num_layers=int(_req(cfg, "num_hidden_layers")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_hidden_size=int(_req(cfg, "intermediate_size")),
        vocab_size=int(_req(cfg, "vocab_size")),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=experts,
        moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Vocabulary size rounded up to a multiple of ``divisible_by * tp_size``."""
    mult = divisible_by * tp_size
    return ((vocab_size + mult - 1) // mult) * mult


@dataclass(frozen=True)
class ParamMap:
    """One Megatron-Core parameter and the Hugging Face tensors it is built from.

    Attributes:
        mcore: canonical name (local spec, global layer index, ``local_experts.{global e}``).
        hf: Hugging Face tensor names, in the order the layout kind expects.
        kind: one of KINDS.
        tp_dim: tensor-parallel partition dim (None = replicated).
        expert: True for routed-expert weights (sharded across EP / expert-TP).
        shapes: expected shape of each HF tensor (empty = unchecked).
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str = "copy"
    tp_dim: int | None = None
    expert: bool = False
    shapes: tuple[tuple[int, ...], ...] = ()
    index: int | None = None  # expert index into an [E, ...] HF tensor (SLICE_KINDS)
    # tp_dim holds these sections one after another, each split over TP (each rank: its slice
    # of every section, as the delta-net's in_proj / conv1d); empty = one plain split
    sections: tuple[int, ...] = ()


# ---------------------------------------------------------------- layout transforms


def _qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: ModelDims):
    # q [nh*hd, *rest], k/v [ng*hd, *rest] -> [ng*(hpg+2)*hd, *rest]
    ng, hd, hpg = d.num_kv_heads, d.head_dim, d.heads_per_group
    rest = q.shape[1:]
    if q.shape[0] != d.num_heads * hd or k.shape[0] != ng * hd or v.shape[0] != ng * hd:
        raise ConversionError(
            f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} do not match "
            f"heads={d.num_heads} kv_heads={ng} head_dim={hd}"
        )
    q = q.reshape(ng, hpg * hd, *rest)
    k = k.reshape(ng, hd, *rest)
    v = v.reshape(ng, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(ng * (hpg + 2) * hd, *rest)


def _qkv_to_hf(qkv: torch.Tensor, d: ModelDims):
    ng, hd, hpg = d.num_kv_heads, d.head_dim, d.heads_per_group
    rest = qkv.shape[1:]
    if qkv.shape[0] != ng * (hpg + 2) * hd:
        raise ConversionError(f"linear_qkv has {qkv.shape[0]} rows, expected {ng * (hpg + 2) * hd}")
    g = qkv.reshape(ng, (hpg + 2) * hd, *rest)
    q, k, v = torch.split(g, [hpg * hd, hd, hd], dim=1)
    return [_packed(q), _packed(k), _packed(v)]


def _packed(x: torch.Tensor) -> torch.Tensor:
    """x [a, b, *rest] (a strided slice) as a new contiguous [a * b, *rest] tensor. Copied
    into a fresh tensor with `copy_` rather than `reshape` (which copies a non-contiguous
    slice several times slower on CPU: about 4x for the q/k/v of a 135M model, on every
    weight sync)."""
    out = torch.empty((x.shape[0] * x.shape[1], *x.shape[2:]), dtype=x.dtype, device=x.device)
    out.view(x.shape).copy_(x)
    return out


def to_mcore_tensor(
    pm: ParamMap, tensors: list[torch.Tensor], dims: ModelDims, padded_vocab: int
) -> torch.Tensor:
    """Build the full (unsharded) Megatron-Core tensor of `pm` from its HF tensors."""
    if len(tensors) != len(pm.hf):
        raise ConversionError(f"{pm.mcore}: got {len(tensors)} tensors for {len(pm.hf)} names")
    for name, t, shape in zip(pm.hf, tensors, pm.shapes or [t.shape for t in tensors], strict=True):
        if tuple(t.shape) != tuple(shape):
            raise ConversionError(
                f"tensor '{name}' has shape {tuple(t.shape)}, expected {tuple(shape)}"
            )
    if pm.kind in ("qkv", "qkv_bias"):
        return _qkv_to_mcore(*tensors, dims)
    if pm.kind in LAYOUTS:
        return LAYOUTS[pm.kind][0](tensors, dims)
    if pm.kind in SLICE_KINDS:
        return slice_to_mcore(pm.kind, tensors[0][pm.index])
    if pm.kind == "glu":
        gate, up = tensors
        if gate.shape != up.shape:
            raise ConversionError(
                f"{pm.hf[0]} {tuple(gate.shape)} and {pm.hf[1]} {tuple(up.shape)} differ in shape"
            )
        return torch.cat([gate, up], dim=0)
    if pm.kind == "vocab_shared":
        for name, other in zip(pm.hf[1:], tensors[1:], strict=True):
            if not torch.equal(other, tensors[0]):
                raise ConversionError(f"tensor '{name}' differs from '{pm.hf[0]}' (Megatron-Core's"
                                      " MTP layers share the main embedding and output layer)")
        tensors = tensors[:1]
    (t,) = tensors
    if pm.kind in VOCAB_KINDS:
        if t.shape[0] > padded_vocab:
            raise ConversionError(f"{pm.hf[0]} has {t.shape[0]} rows > padded vocab {padded_vocab}")
        if t.shape[0] < padded_vocab:
            pad = t.new_zeros((padded_vocab - t.shape[0], *t.shape[1:]))
            t = torch.cat([t, pad], dim=0)
    return t


def to_hf_tensors(pm: ParamMap, full: torch.Tensor, dims: ModelDims) -> list[torch.Tensor]:
    """Split a full Megatron-Core tensor back into its HF tensors (same order as ``pm.hf``)."""
    if pm.kind in ("qkv", "qkv_bias"):
        return _qkv_to_hf(full, dims)
    if pm.kind in LAYOUTS:
        return LAYOUTS[pm.kind][1](full, dims)
    if pm.kind in SLICE_KINDS:  # this expert's piece, in the HF layout (`ExpertSlices` stacks)
        return [slice_to_hf(pm.kind, full)]
    if pm.kind == "glu":
        if full.shape[0] % 2:
            raise ConversionError(f"{pm.mcore} has an odd number of rows {full.shape[0]}")
        return [t.contiguous() for t in torch.chunk(full, 2, dim=0)]
    if pm.kind in VOCAB_KINDS:
        t = full[: dims.vocab_size].contiguous()
        return [t] + [t.clone() for _ in pm.hf[1:]]
    return [full]


# ---------------------------------------------------------------- adapter


class StateDictAdapter:
    """Base adapter: dense decoder with RMSNorm, SwiGLU MLP, rotary attention.

    Subclasses set the class attributes that differ between architectures and may override
    `mlp_maps` (MoE) or `check_config`.
    """

    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    qkv_bias: bool = False
    qk_norm: bool = False

    def check_config(self, cfg: Mapping) -> None:
        """Reject config features this adapter cannot map (one-line ConversionError)."""
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key) and not (key == "attention_bias" and self.qkv_bias):
                raise ConversionError(
                    f"config.json: {key}=true is not supported for {self.architectures[0]}"
                )

    def dims(self, cfg: Mapping) -> ModelDims:
        """Check `cfg` and return its ModelDims."""
        self.check_config(cfg)
        return dims_from_hf_config(cfg)

    # -- mapping lists
    def attention_maps(self, i: int, d: ModelDims) -> list[ParamMap]:
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        H, q, kv = d.hidden_size, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        maps = [
            ParamMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), shapes=((H,),)),
            ParamMap(
                m + "self_attention.linear_qkv.weight",
                (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                "qkv",
                0,
                shapes=((q, H), (kv, H), (kv, H)),
            ),
            ParamMap(
                m + "self_attention.linear_proj.weight",
                (a + "o_proj.weight",),
                tp_dim=1,
                shapes=((H, q),),
            ),
            ParamMap(
                m + "pre_mlp_layernorm.weight",
                (h + "post_attention_layernorm.weight",),
                shapes=((H,),),
            ),
        ]
        if self.qkv_bias:
            maps.append(
                ParamMap(
                    m + "self_attention.linear_qkv.bias",
                    (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                    "qkv_bias",
                    0,
                    shapes=((q,), (kv,), (kv,)),
                )
            )
        if self.qk_norm:
            for x in ("q", "k"):
                maps.append(
                    ParamMap(
                        m + f"self_attention.{x}_layernorm.weight",
                        (a + f"{x}_norm.weight",),
                        shapes=((d.head_dim,),),
                    )
                )
        return maps

    def mlp_maps(self, i: int, d: ModelDims) -> list[ParamMap]:
        h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        H, F = d.hidden_size, d.ffn_hidden_size
        return [
            ParamMap(
                m + "linear_fc1.weight",
                (h + "gate_proj.weight", h + "up_proj.weight"),
                "glu",
                0,
                shapes=((F, H), (F, H)),
            ),
            ParamMap(
                m + "linear_fc2.weight", (h + "down_proj.weight",), tp_dim=1, shapes=((H, F),)
            ),
        ]

    def is_moe_layer(self, i: int, dims: ModelDims) -> bool:
        return False

    def param_maps(self, dims: ModelDims) -> list[ParamMap]:
        """All ParamMaps of the model, embedding first, output layer last."""
        emb = ((dims.vocab_size, dims.hidden_size),)
        maps = [
            ParamMap(
                "embedding.word_embeddings.weight",
                ("model.embed_tokens.weight",),
                "vocab",
                0,
                shapes=emb,
            )
        ]
        for i in range(dims.num_layers):
            maps += self.attention_maps(i, dims) + self.mlp_maps(i, dims)
        maps.append(
            ParamMap(
                "decoder.final_layernorm.weight",
                ("model.norm.weight",),
                shapes=((dims.hidden_size,),),
            )
        )
        if not dims.tie_embeddings:
            maps.append(
                ParamMap("output_layer.weight", ("lm_head.weight",), "vocab", 0, shapes=emb)
            )
        return maps

    # -- whole state dict conversion (names in canonical or TE spelling)
    def hf_to_mcore(
        self,
        get_hf: Callable[[str], torch.Tensor],
        dims: ModelDims,
        padded_vocab: int,
        spec: str = "local",
    ) -> dict[str, torch.Tensor]:
        """Convert a whole HF state dict to a full (unsharded) Megatron-Core state dict.

        Args:
            get_hf: returns the HF tensor of a name (raises ConversionError when missing).
            dims: model sizes.
            padded_vocab: rows of the Megatron embedding / output layer.
            spec: "local" or "te" parameter spelling.
        Returns:
            dict of Megatron-Core name -> tensor.
        """
        out = {}
        for pm in self.param_maps(dims):
            name = self.spell(pm.mcore, dims, spec)
            out[name] = to_mcore_tensor(pm, [get_hf(n) for n in pm.hf], dims, padded_vocab)
        return out

    def mcore_to_hf(
        self, mcore_sd: Mapping[str, torch.Tensor], dims: ModelDims, spec: str = "local"
    ) -> dict[str, torch.Tensor]:
        """Convert a full Megatron-Core state dict back to HF names and layouts.

        Raises ConversionError naming the first missing Megatron-Core tensor.
        """
        out, slices = {}, ExpertSlices()
        for pm in self.param_maps(dims):
            name = self.spell(pm.mcore, dims, spec)
            if name not in mcore_sd:
                raise ConversionError(f"Megatron state dict is missing tensor '{name}'")
            pieces = to_hf_tensors(pm, mcore_sd[name], dims)
            if pm.kind in SLICE_KINDS:
                full = slices.add(pm, pm.hf[0], pieces[0])
                if full is not False:
                    out[pm.hf[0]] = full
                continue
            out.update(zip(pm.hf, pieces, strict=True))
        return out

    def spell(self, canonical: str, dims: ModelDims, spec: str) -> str:
        """Canonical name in the spelling of `spec` ("local" or "te")."""
        if spec == "local":
            return canonical
        if spec != "te":
            raise ConversionError(f"unknown layer spec '{spec}' (expected 'local' or 'te')")
        mo = re.match(r"decoder\.layers\.(\d+)\.", canonical)
        return to_te_name(canonical, moe=bool(mo) and self.is_moe_layer(int(mo.group(1)), dims))

    def bucket_group(self, hf_name: str, dims: ModelDims) -> tuple[str, int] | None:
        """(key, size) of the group of HF tensors `hf_name` must share a weight-sync bucket
        with (the engine's loader fuses them only when they arrive together); None: no group."""
        return None

    def maps_by_mcore(self, dims: ModelDims) -> dict[str, ParamMap]:
        """Canonical Megatron-Core name -> ParamMap."""
        return {pm.mcore: pm for pm in self.param_maps(dims)}

    def hf_names(self, dims: ModelDims) -> Iterable[str]:
        """Every HF tensor name the model has (in mapping order)."""
        for pm in self.param_maps(dims):
            yield from pm.hf
