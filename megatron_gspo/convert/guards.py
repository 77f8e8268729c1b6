"""Checks that keep a conversion from destroying its input or writing a wrong model.

- `check_out_disjoint`: the output directory must not be, contain, or sit inside an input
  (after resolving symlinks), because replacing it (``--force``) would delete the input.
- `model_fields` / `compare_configs`: the config fields that decide what the model computes
  (sizes, tied embeddings, norm epsilon, RoPE, MoE routing), with Hugging Face's defaults
  filled in, compared between a given config and the one stored with a checkpoint.
- `checkpoint_shapes` / `check_config_against_shapes`: the same fields checked against the
  global tensor shapes recorded in a torch_dist checkpoint's metadata (no tensor is read).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

from megatron_gspo.convert.param_map import ConversionError, num_routed_experts
from megatron_gspo.convert.registry import get_adapter

VOCAB_PAD_MULTIPLE = 128  # as megatron_gspo.megatron.models.builder pads the vocabulary
# full-attention layers with a sigmoid output gate (Megatron-Core's attention_output_gate)
GATED_ATTENTION = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def check_out_disjoint(out: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None],
                       out_flag: str = "--out"):
    """Refuse an output directory that is, contains, or lies inside one of `inputs`.

    Args:
        out: the output directory (need not exist).
        inputs: what names each input in the message (a flag such as "--hf", or a phrase
            starting with "the ") -> its path (None: skip).
        out_flag: how the output is named in the message.
    """
    o = Path(os.path.realpath(out))
    for flag, path in inputs.items():
        if path is None:
            continue
        i = Path(os.path.realpath(path))
        if o == i:
            how = "is"
        elif o in i.parents:
            how = "contains"
        elif i in o.parents:
            how = "is inside"
        else:
            continue
        name = flag if flag.startswith("the ") else f"the input {flag}"
        raise ConversionError(
            f"{out_flag} {out} {how} {name} {path}; choose an output directory outside "
            "the inputs (--force would delete or mix with input files)"
        )


def check_out_writable(out: str | os.PathLike) -> None:
    """Refuse an output directory that cannot be created and written (checked before any
    input is read): its nearest existing ancestor must be a directory that takes a new file.

    Args:
        out: the output directory (need not exist; replaced through a temp directory beside
            it, so the parent must be writable too).
    """
    import tempfile

    o = Path(os.path.abspath(out))
    if o.exists() and not o.is_dir():
        raise ConversionError(f"--out {out} cannot be written: it is a file, not a directory")
    base = o.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ConversionError(f"--out {out} cannot be written: {base} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write_check_", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConversionError(f"--out {out} cannot be written: {base}: "
                              f"{e.strerror or e}") from None


def _rope(cfg: Mapping) -> tuple[float, tuple | None]:
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (
        params if params.get("rope_type", "default") != "default" else None
    )
    if scaling and scaling.get("rope_type", scaling.get("type")) != "default":
        kept = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
        kept["rope_type"] = scaling.get("rope_type", scaling.get("type"))
        return theta, tuple(sorted((k, repr(v)) for k, v in kept.items()))
    return theta, None


#: MoE fields of the families beyond Qwen3-MoE, with transformers' defaults (5.24 config
#: classes) for a config that leaves them out.
FAMILY_MOE_FIELDS = {
    "DeepseekV3ForCausalLM": {"n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8,
                              "topk_group": 4, "routed_scaling_factor": 2.5,
                              "norm_topk_prob": True},
    "Glm4MoeForCausalLM": {"n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                           "topk_group": 1, "routed_scaling_factor": 1.0,
                           "norm_topk_prob": True},
    "GptOssForCausalLM": {"swiglu_limit": 7.0},
}
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")


#: Attention fields of the families with sliding-window layers, with transformers' defaults
#: (5.24 config classes: Gemma3TextConfig, GptOssConfig) for a config that leaves them out.
FAMILY_ATTENTION_FIELDS = {
    "Gemma3ForCausalLM": {"sliding_window": 4096, "query_pre_attn_scalar": 256,
                          "attn_logit_softcapping": None, "final_logit_softcapping": None},
    "GptOssForCausalLM": {"sliding_window": 128},
}


def _layer_types(cfg: Mapping, arch: str) -> tuple[str, ...]:
    """Each layer's attention type; transformers' default pattern where a config leaves it out
    (Gemma 3: every `sliding_window_pattern`-th layer global, default 6; gpt-oss: sliding
    first, alternating)."""
    n = int(cfg.get("num_hidden_layers") or 0)
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    if arch == "Gemma3ForCausalLM":
        k = int(cfg.get("sliding_window_pattern") or 6)
        return tuple("full_attention" if (i + 1) % k == 0 else "sliding_attention"
                     for i in range(n))
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n))


def _gemma3_rope(cfg: Mapping) -> dict:
    """Gemma 3's two rotary settings, from either spelling: transformers 5's `rope_parameters`
    keyed by layer type, or 4.x's `rope_theta` / `rope_scaling` (global layers) and
    `rope_local_base_freq` (sliding layers)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta, scaling = _rope({"rope_parameters": {"rope_theta": 1e6, **full}})
        return {"rope_theta": theta, "rope_scaling": scaling,
                "rope_local_base_freq": float(local.get("rope_theta", 1e4))}
    theta, scaling = _rope({"rope_theta": 1e6, **cfg})
    return {"rope_theta": theta, "rope_scaling": scaling,
            "rope_local_base_freq": float(cfg.get("rope_local_base_freq", 1e4))}


def experts_key(cfg: Mapping) -> str:
    """The field a config counts its routed experts in: ``num_experts`` (Qwen3-MoE),
    ``num_local_experts`` (gpt-oss, transformers 5) or ``n_routed_experts`` (DeepSeek, GLM)."""
    return next((k for k in ("num_experts", "num_local_experts", "n_routed_experts")
                 if cfg.get(k)), "num_experts")


def model_fields(cfg: Mapping) -> dict:
    """Fields of a Hugging Face config that change the model's function, defaults filled in.

    Args:
        cfg: parsed config.json.
    Returns:
        field name -> value (comparable with ==).
    """
    heads = int(cfg.get("num_attention_heads") or 0)
    hidden = int(cfg.get("hidden_size") or 0)
    experts = num_routed_experts(cfg)
    theta, scaling = _rope(cfg)
    try:  # a config naming only its model_type is the same architecture
        arch = get_adapter(cfg).architectures[0]
    except ConversionError:
        arch = (cfg.get("architectures") or [cfg.get("model_type")])[0]
    out = {
        "architectures": arch,
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or (hidden // heads if heads else 0)),
        "intermediate_size": cfg.get("intermediate_size"),
        "vocab_size": cfg.get("vocab_size"),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "hidden_act": cfg.get("hidden_act", "silu"),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "use_sliding_window": bool(cfg.get("use_sliding_window", False)),
        "num_experts": experts,
    }
    if experts:
        out.update(
            num_experts_per_tok=cfg.get("num_experts_per_tok"),
            # (gpt-oss: its experts' width is intermediate_size; it has no dense layers)
            moe_intermediate_size=cfg.get("moe_intermediate_size") or (
                cfg.get("intermediate_size") if arch == "GptOssForCausalLM" else None),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
        for k, default in FAMILY_MOE_FIELDS.get(arch, {}).items():
            v = cfg.get(k)
            out[k] = type(default)(default if v is None else v)
    if arch == "DeepseekV3ForCausalLM":
        out.update({k: int(cfg.get(k) or 0) for k in MLA_FIELDS})
    if arch in FAMILY_ATTENTION_FIELDS:
        for k, default in FAMILY_ATTENTION_FIELDS[arch].items():
            out[k] = cfg.get(k, default)
        out["layer_types"] = _layer_types(cfg, arch)
    if arch == "Gemma3ForCausalLM":
        out.update(_gemma3_rope(cfg))
    if arch in GATED_ATTENTION:  # linear_qkv holds a gate per query head too
        out["attention_output_gate"] = True
    return out


def compare_configs(given: Mapping, stored: Mapping, given_name: str, stored_name: str) -> None:
    """Refuse (one line naming every differing field) when `given` and `stored` describe
    different models."""
    a, b = model_fields(given), model_fields(stored)
    diff = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    if diff:
        name = {"num_experts": experts_key(given)}  # the field as the given config spells it
        shown = "; ".join(f"{name.get(k, k)}: {a.get(k)!r} vs {b.get(k)!r}" for k in diff)
        raise ConversionError(
            f"{given_name} does not describe the model of {stored_name} "
            f"({', '.join(name.get(k, k) for k in diff)} differ; given vs stored: {shown})"
        )


def checkpoint_shapes(dist_dir: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """Global shape and dtype of every tensor of a torch_dist checkpoint (metadata only).

    Returns:
        key -> (shape, dtype name such as "float32"); ConversionError when unreadable.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        meta = FileSystemReader(str(dist_dir)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure means an unreadable checkpoint
        raise ConversionError(f"{dist_dir}: unreadable checkpoint metadata ({e})") from None
    return {
        k: (tuple(v.size), str(v.properties.dtype).removeprefix("torch."))
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def _vocab_rows_fit(vocab: int, rows: int) -> bool:
    """Whether `rows` is the padded vocabulary of `vocab` under some TP size."""
    for tp in range(1, 65):
        m = math.lcm(VOCAB_PAD_MULTIPLE, tp)
        if math.ceil(vocab / m) * m == rows:
            return True
    return False


def _per_layer(shapes: Mapping) -> dict[str, dict[int, tuple[int, ...]]]:
    """Checkpoints written layer by layer (families with dense and MoE layers, MLA):
    "decoder.layers.<i>.<rest>" -> {"decoder.layers.<rest>": {i: shape}}."""
    out: dict[str, dict[int, tuple[int, ...]]] = {}
    for key, (shape, _) in shapes.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
        if m:
            out.setdefault(f"decoder.layers.{m[2]}", {})[int(m[1])] = tuple(shape)
    return out


def _attention_want(f: Mapping, layers, hid) -> dict:
    """Expected [layers, ...] shapes of the attention tensors (MLA for DeepSeek-V3)."""
    a, nh = "decoder.layers.self_attention.", f["num_attention_heads"]
    if "kv_lora_rank" in f:
        q, kv, rope = f["q_lora_rank"], f["kv_lora_rank"], f["qk_rope_head_dim"]
        qd, vd = f["qk_nope_head_dim"] + rope, f["v_head_dim"]
        heads = ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim")
        want = {a + "linear_kv_down_proj.weight": [layers, (kv + rope, (
                    "kv_lora_rank", "qk_rope_head_dim")), hid],
                a + "linear_kv_up_proj.weight": [layers, (nh * (qd - rope + vd), (
                    "num_attention_heads", "qk_nope_head_dim", "v_head_dim")),
                    (kv, ("kv_lora_rank",))],
                a + "linear_proj.weight": [layers, hid, (nh * vd, ("num_attention_heads",
                                                                   "v_head_dim"))],
                a + "kv_layernorm.weight": [layers, (kv, ("kv_lora_rank",))]}
        if q:
            want[a + "linear_q_down_proj.weight"] = [layers, (q, ("q_lora_rank",)), hid]
            want[a + "linear_q_up_proj.weight"] = [layers, (nh * qd, heads),
                                                   (q, ("q_lora_rank",))]
            want[a + "q_layernorm.weight"] = [layers, (q, ("q_lora_rank",))]
        else:
            want[a + "linear_q_proj.weight"] = [layers, (nh * qd, heads), hid]
        return want
    nkv, hd = f["num_key_value_heads"], f["head_dim"]
    heads = ("num_attention_heads", "num_key_value_heads", "head_dim")
    nq = 2 * nh if f.get("attention_output_gate") else nh  # [q; gate] rows per query head
    return {a + "linear_qkv.weight": [layers, ((nq + 2 * nkv) * hd, heads), hid],
            a + "linear_proj.weight": [layers, hid, (nh * hd, heads)],
            a + "q_layernorm.weight": [layers, (hd, ("head_dim",))]}


def check_config_against_shapes(cfg: Mapping, shapes: Mapping, cfg_name: str, ckpt: str) -> None:
    """Refuse (one line naming the fields) a config whose sizes disagree with the checkpoint's
    tensors, stacked over layers or stored layer by layer (then also the layer count and, for
    the families with leading dense layers, how many lead). Tensors the checkpoint spells
    differently are not checked.

    Args:
        cfg: the Hugging Face config to convert with.
        shapes: from `checkpoint_shapes`.
        cfg_name, ckpt: how to name the config and the checkpoint in the message.
    """
    f = model_fields(cfg)
    L, H = f["num_hidden_layers"], f["hidden_size"]
    F, E = f["intermediate_size"], f["num_experts"]
    layers = (L, ("num_hidden_layers",))
    hid = (H, ("hidden_size",))
    # key -> per dimension: (expected size, fields deciding it)
    want = {"decoder.final_layernorm.weight": [hid], **_attention_want(f, layers, hid)}
    ffn = (2 * (F or 0), ("intermediate_size",))
    want["decoder.layers.mlp.linear_fc1.weight"] = [layers, ffn, hid]  # dense (leading) layers
    want["decoder.layers.mlp.linear_fc2.weight"] = [layers, hid, (F, ("intermediate_size",))]
    if E:
        Fe = f.get("moe_intermediate_size") or 0
        experts = (E, (experts_key(cfg),))
        moe_ffn = ("moe_intermediate_size",)
        want["decoder.layers.mlp.router.weight"] = [layers, experts, hid]
        want["decoder.layers.mlp.router.expert_bias"] = [layers, experts]
        want["decoder.layers.mlp.experts.experts.linear_fc1.weight"] = [
            layers, experts, (2 * Fe, moe_ffn), hid]
        want["decoder.layers.mlp.experts.experts.linear_fc2.weight"] = [
            layers, experts, hid, (Fe, moe_ffn)]
        if f.get("n_shared_experts"):
            shared = (Fe * f["n_shared_experts"], ("moe_intermediate_size", "n_shared_experts"))
            want["decoder.layers.mlp.shared_experts.linear_fc1.weight"] = [
                layers, (2 * shared[0], shared[1]), hid]
            want["decoder.layers.mlp.shared_experts.linear_fc2.weight"] = [layers, hid, shared]
    per = _per_layer(shapes)
    problems: dict[str, str] = {}
    if per:
        n = 1 + max(i for d in per.values() for i in d)
        if n != L:
            problems["num_hidden_layers"] = (f"num_hidden_layers: the checkpoint has {n} "
                                             f"layers where the config gives {L}")
        dense = per.get("decoder.layers.mlp.linear_fc1.weight", {})
        lead = next((i for i in range(n) if i not in dense), n)
        if "first_k_dense_replace" in f and E and lead != f["first_k_dense_replace"]:
            problems["first_k_dense_replace"] = (
                f"first_k_dense_replace: the checkpoint has {lead} leading dense layers where "
                f"the config gives {f['first_k_dense_replace']}")
    found = [(key, shape, dims) for key, dims in want.items() if key in shapes
             for shape in [shapes[key][0]]]
    found += [(key.replace("layers.", f"layers.{i}.", 1), shape, dims[1:])
              for key, dims in want.items() if key.startswith("decoder.layers.")
              for i, shape in sorted(per.get(key, {}).items())]
    for key, got, dims in found:
        if len(got) != len(dims):
            problems.setdefault(key, f"{key} has {len(got)} dims, expected {len(dims)}")
            continue
        for (size, fields), g in zip(dims, got, strict=True):
            if size != g:
                name = "/".join(fields)
                problems.setdefault(name, f"{name}: {key} has {g} where the config gives {size}")
    emb = shapes.get("embedding.word_embeddings.weight")
    if emb is not None:
        rows, width = emb[0][0], emb[0][-1]
        if width != H:
            problems.setdefault("hidden_size", f"hidden_size: embedding width {width}, config {H}")
        if not _vocab_rows_fit(int(f["vocab_size"] or 0), rows):
            problems["vocab_size"] = (f"vocab_size: {f['vocab_size']} does not pad to the "
                                      f"checkpoint's {rows} embedding rows")
        has_output = "output_layer.weight" in shapes
        if f["tie_word_embeddings"] and has_output:
            problems["tie_word_embeddings"] = ("tie_word_embeddings: true, but the checkpoint "
                                               "has a separate output_layer.weight")
        elif not f["tie_word_embeddings"] and not has_output:
            problems["tie_word_embeddings"] = ("tie_word_embeddings: false, but the checkpoint "
                                               "has no output_layer.weight")
    qkv = "decoder.layers.self_attention.linear_qkv."
    if qkv + "weight" in shapes or qkv + "weight" in per:
        has_bias = qkv + "bias" in shapes or qkv + "bias" in per
        want_bias = f["attention_bias"] or f["architectures"] == "Qwen2ForCausalLM"
        if has_bias != want_bias:
            problems["attention_bias"] = (f"attention_bias: the checkpoint "
                                          f"{'has' if has_bias else 'has no'} q/k/v biases")
    if problems:
        raise ConversionError(
            f"{cfg_name} does not match the tensors of {ckpt}: " + "; ".join(problems.values())
        )
