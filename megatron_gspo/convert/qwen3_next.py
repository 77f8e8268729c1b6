"""State-dict adapter for Qwen3-Next (Qwen3NextForCausalLM): gated delta-net and gated
full-attention layers, Qwen3-MoE experts plus a gated shared expert.

Layouts beyond the base adapter's (registered in `base.LAYOUTS`):
- ``gated_qkv``: ``q_proj`` emits [q_h; gate_h] per head (transformers chunks each head's
  2 * head_dim rows); Megatron-Core's `attention_output_gate` linear_qkv holds, per query
  group, [q heads of the group; their gate heads; k; v] (`attention.py`
  `get_query_key_value_tensors`).
- ``gdn_in``: ``in_proj_qkvz`` is grouped per key head, [q_h (dk); k_h (dk); v (r * dv);
  z (r * dv)] with r = value heads / key heads, and ``in_proj_ba`` [b (r); a (r)] per key head;
  Megatron-Core's GatedDeltaNet ``in_proj`` holds [q; k; v; z; beta; alpha], each over all
  heads (the full, one-rank layout); a TP rank holds its slice of every section
  (``ParamMap.sections``), as does the conv1d's [q; k; v].
- the causal conv's channels are [q; k; v] over all heads on both sides (``conv1d.weight``
  copied); the gated output norm (``linear_attn.norm``, weight initialised to ones) is copied
  to ``out_norm`` (a plain RMSNorm in the spec, no -1 shift as Megatron-Bridge needs for its
  zero-centred one); the zero-centred norms keep their checkpoint values (1 + weight in the spec).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_gspo.convert.param_map import (
    LAYOUTS,
    ConversionError,
    ModelDims,
    ParamMap,
    StateDictAdapter,
    _packed,
    dims_from_hf_config,
)
from megatron_gspo.convert.qwen3_moe import Qwen3MoeAdapter


@dataclass(frozen=True)
class Qwen3NextDims(ModelDims):
    """ModelDims plus the per-layer pattern and the delta-net sizes."""

    linear: tuple[bool, ...] = ()
    moe: tuple[bool, ...] = ()
    lk_heads: int = 0
    lv_heads: int = 0
    lk_dim: int = 0
    lv_dim: int = 0
    conv: int = 4
    shared_ffn: int = 0


def layer_types(cfg: dict) -> list[str]:
    """Per layer "linear_attention" / "full_attention" (`layer_types`, or every
    `full_attention_interval`-th layer full)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:
        every = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n)]
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if len(types) != n or bad:
        raise ConversionError(f"config.json layer_types: {len(types)} entries for {n} "
                                   "layers" + (f", unknown {bad}" if bad else ""))
    return list(types)


def moe_layers(cfg: dict) -> list[int]:
    """Per layer 1 (MoE) / 0 (dense MLP), as transformers decides."""
    n, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    experts = int(cfg.get("num_experts") or 0)
    return [int(experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(n)]


def _gated_qkv_to_mcore(t, d):
    q, k, v = t
    ng, hd, hpg, H = d.num_kv_heads, d.head_dim, d.heads_per_group, q.shape[1]
    qg = q.reshape(ng, hpg, 2, hd, H)
    parts = [qg[:, :, 0].reshape(ng, hpg * hd, H), qg[:, :, 1].reshape(ng, hpg * hd, H),
             k.reshape(ng, hd, H), v.reshape(ng, hd, H)]
    return torch.cat(parts, dim=1).reshape(-1, H)


def _gated_qkv_to_hf(full, d):
    ng, hd, hpg, H = d.num_kv_heads, d.head_dim, d.heads_per_group, full.shape[1]
    g = full.reshape(ng, (2 * hpg + 2) * hd, H)
    q, gate, k, v = torch.split(g, [hpg * hd, hpg * hd, hd, hd], dim=1)
    qg = torch.stack([q.reshape(ng, hpg, hd, H), gate.reshape(ng, hpg, hd, H)], dim=2)
    return [qg.reshape(-1, H).contiguous(), _packed(k), _packed(v)]


def _gdn_sections(d):
    r = d.lv_heads // d.lk_heads
    return r, [d.lk_dim, d.lk_dim, r * d.lv_dim, r * d.lv_dim]


def _gdn_in_to_mcore(t, d):
    qkvz, ba = t
    nk, H = d.lk_heads, qkvz.shape[1]
    r, sec = _gdn_sections(d)
    q, k, v, z = torch.split(qkvz.reshape(nk, sum(sec), H), sec, dim=1)
    b, a = torch.split(ba.reshape(nk, 2 * r, H), [r, r], dim=1)
    return torch.cat([x.reshape(-1, H) for x in (q, k, v, z, b, a)], dim=0)


def _gdn_in_to_hf(full, d):
    nk, H = d.lk_heads, full.shape[1]
    r, sec = _gdn_sections(d)
    sizes = [nk * s for s in sec] + [nk * r, nk * r]
    q, k, v, z, b, a = (x.reshape(nk, -1, H) for x in torch.split(full, sizes, dim=0))
    return [torch.cat([q, k, v, z], dim=1).reshape(-1, H).contiguous(),
            torch.cat([b, a], dim=1).reshape(-1, H).contiguous()]


LAYOUTS.update(gated_qkv=(_gated_qkv_to_mcore, _gated_qkv_to_hf),
               gdn_in=(_gdn_in_to_mcore, _gdn_in_to_hf))


class Qwen3NextAdapter(Qwen3MoeAdapter):
    """Qwen3-Next: `layer_types` picks delta-net or gated attention per layer."""

    architectures = ("Qwen3NextForCausalLM",)
    model_types = ("qwen3_next",)
    qk_norm = True

    def check_config(self, cfg: Mapping) -> None:
        StateDictAdapter.check_config(self, cfg)
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "num_experts", "moe_intermediate_size",
                    "shared_expert_intermediate_size"):
            if not cfg.get(key):
                raise ConversionError(f"config.json: missing required field '{key}'")
        if int(cfg["linear_num_value_heads"]) % int(cfg["linear_num_key_heads"]):
            raise ConversionError("config.json: linear_num_value_heads must be a multiple of "
                                  "linear_num_key_heads")

    def dims(self, cfg: Mapping) -> Qwen3NextDims:
        self.check_config(cfg)
        base = dims_from_hf_config(cfg)
        fields = {k: getattr(base, k) for k in ModelDims.__dataclass_fields__}
        return Qwen3NextDims(
            **fields, linear=tuple(t == "linear_attention" for t in layer_types(dict(cfg))),
            moe=tuple(bool(m) for m in moe_layers(dict(cfg))),
            lk_heads=int(cfg["linear_num_key_heads"]), lv_heads=int(cfg["linear_num_value_heads"]),
            lk_dim=int(cfg["linear_key_head_dim"]), lv_dim=int(cfg["linear_value_head_dim"]),
            conv=int(cfg.get("linear_conv_kernel_dim") or 4),
            shared_ffn=int(cfg["shared_expert_intermediate_size"]))

    def is_moe_layer(self, i: int, dims: ModelDims) -> bool:
        return dims.moe[i]

    def attention_maps(self, i: int, d: Qwen3NextDims) -> list[ParamMap]:
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        H = d.hidden_size
        norms = [ParamMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",),
                          shapes=((H,),)),
                 ParamMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",),
                          shapes=((H,),))]
        if not d.linear[i]:
            a, s = h + "self_attn.", m + "self_attention."
            q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
            return norms + [
                ParamMap(s + "linear_qkv.weight", (a + "q_proj.weight", a + "k_proj.weight",
                                                   a + "v_proj.weight"), "gated_qkv", 0,
                         shapes=((2 * q, H), (kv, H), (kv, H))),
                ParamMap(s + "linear_proj.weight", (a + "o_proj.weight",), tp_dim=1,
                         shapes=((H, q),)),
                ParamMap(s + "q_layernorm.weight", (a + "q_norm.weight",), shapes=((d.head_dim,),)),
                ParamMap(s + "k_layernorm.weight", (a + "k_norm.weight",), shapes=((d.head_dim,),)),
            ]
        a, s = h + "linear_attn.", m + "self_attention."
        qk, v = d.lk_heads * d.lk_dim, d.lv_heads * d.lv_dim
        conv = 2 * qk + v
        return norms + [
            ParamMap(s + "in_proj.weight", (a + "in_proj_qkvz.weight", a + "in_proj_ba.weight"),
                     "gdn_in", 0, shapes=((2 * qk + 2 * v, H), (2 * d.lv_heads, H)),
                     sections=(qk, qk, v, v, d.lv_heads, d.lv_heads)),
            ParamMap(s + "conv1d.weight", (a + "conv1d.weight",), tp_dim=0,
                     shapes=((conv, 1, d.conv),), sections=(qk, qk, v)),
            ParamMap(s + "dt_bias", (a + "dt_bias",), tp_dim=0, shapes=((d.lv_heads,),)),
            ParamMap(s + "A_log", (a + "A_log",), tp_dim=0, shapes=((d.lv_heads,),)),
            ParamMap(s + "out_norm.weight", (a + "norm.weight",), shapes=((d.lv_dim,),)),
            ParamMap(s + "out_proj.weight", (a + "out_proj.weight",), tp_dim=1, shapes=((H, v),)),
        ]

    def mlp_maps(self, i: int, d: Qwen3NextDims) -> list[ParamMap]:
        if not d.moe[i]:
            return StateDictAdapter.mlp_maps(self, i, d)
        h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        H, F = d.hidden_size, d.shared_ffn
        return super().mlp_maps(i, d) + [
            ParamMap(m + "shared_experts.linear_fc1.weight",
                     (h + "shared_expert.gate_proj.weight", h + "shared_expert.up_proj.weight"),
                     "glu", 0, shapes=((F, H), (F, H))),
            ParamMap(m + "shared_experts.linear_fc2.weight",
                     (h + "shared_expert.down_proj.weight",), tp_dim=1, shapes=((H, F),)),
            ParamMap(m + "shared_experts.gate_weight", (h + "shared_expert_gate.weight",),
                     shapes=((1, H),)),
        ]

    def bucket_group(self, hf_name: str, dims: ModelDims) -> tuple[str, int] | None:
        return None
