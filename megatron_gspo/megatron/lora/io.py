"""LoRA checkpoints and exports.

A LoRA run checkpoint's `model/` directory holds the adapters and their optimizer state only
(Megatron `dist_checkpointing`, reshardable) and `lora.json`: the adapter settings and the base
model it was trained on (`base`: `model.path`, or `model.load_checkpoint` when set). The base
weights themselves are read from there on resume and by the export.

The PEFT export (`peft_state_dict`, `write_peft_adapter`) writes `adapter_config.json` +
`adapter_model.safetensors` with PEFT's names for the Hugging Face model
(`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`, ...): the fused QKV
adapter becomes q/k/v adapters sharing A (B cut into the q, k, v rows), the fused [gate; up]
adapter becomes gate_proj/up_proj adapters sharing A; routed experts map to
`mlp.experts.<e>.{gate,up,down}_proj`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from megatron_gspo.megatron.lora.adapters import LoraSettings

INFO_NAME = "lora.json"


def write_adapter_info(path: str | os.PathLike, settings: LoraSettings, base: str | None) -> None:
    """Write `lora.json` (settings, the base and its `weights_fingerprint`) into a checkpoint's
    model directory."""
    from megatron_gspo.convert.sources import weights_fingerprint

    info = {"rank": settings.rank, "alpha": settings.alpha, "dropout": settings.dropout,
            "targets": list(settings.targets), "base": base,
            "base_fingerprint": weights_fingerprint(base) if base else None}
    (Path(path) / INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")


def read_adapter_info(path: str | os.PathLike) -> dict | None:
    """`lora.json` of a checkpoint's model directory (None: not a LoRA checkpoint)."""
    f = Path(path) / INFO_NAME
    return json.loads(f.read_text()) if f.is_file() else None


def base_mismatch(info: dict, base: str | os.PathLike) -> str | None:
    """Why `base` is not the base model `info` (lora.json) records, None when it is (or when
    nothing recorded can tell): its fingerprint, else the recorded directory's weights."""
    from megatron_gspo.convert.sources import other_weights

    return other_weights(base, info.get("base"), info.get("base_fingerprint"))


def adapter_mismatch(info: dict, settings: LoraSettings) -> tuple[str, object, object] | None:
    """The first adapter setting that differs from lora.json: (key, recorded, given), or None.
    Rank and targets shape the adapters; alpha scales them (a resumed run with another alpha
    would change the model it continues)."""
    for key, want in (("rank", settings.rank), ("targets", list(settings.targets)),
                      ("alpha", settings.alpha)):
        got = info.get(key)
        same = got == want if key != "alpha" else got is not None and float(got) == float(want)
        if not same:
            return key, got, want
    return None


def check_adapter_info(path: str | os.PathLike, settings: LoraSettings) -> None:
    """Refuse, in one line, a checkpoint whose adapters differ from `settings` in shape,
    placement or scale (rank, targets, alpha) or that holds full weights."""
    info = read_adapter_info(path)
    if info is None:
        raise ValueError(f"{path}: not a LoRA checkpoint (no {INFO_NAME}) but model.lora is on")
    diff = adapter_mismatch(info, settings)
    if diff is not None:
        key, got, want = diff
        raise ValueError(f"{path}: checkpoint adapters have {key}={got!r}, "
                         f"model.lora.{key} is {want!r}")


# ----------------------------------------------------------------------------- PEFT naming
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.(lora_a|lora_b)$")


def peft_state_dict(full: dict[str, torch.Tensor], dims) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors from the learner's full adapter factors.

    Args:
        full: {megatron global name ending in .lora_a / .lora_b: full tensor} (TP=PP=EP=1
            layout, e.g. `weights.gather_full` filtered to adapters).
        dims: `ModelDims` of the HF architecture (head counts for the QKV split).
    Returns:
        {PEFT name: tensor}.
    """
    from megatron_gspo.convert.base import _qkv_to_hf

    out: dict[str, torch.Tensor] = {}
    pre = "base_model.model.model.layers"
    for name, t in sorted(full.items()):
        m = _LAYER.match(name)
        if m is None:
            raise ValueError(f"adapter tensor {name!r} has no PEFT name")
        layer, module, factor = int(m.group(1)), m.group(2), m.group(3)
        ab = "lora_A" if factor == "lora_a" else "lora_B"
        e = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])$", module)
        mlp = f"mlp.experts.{e.group(1)}" if e else "mlp"
        fc = e.group(2) if e else module.rsplit(".", 1)[-1]
        if module == "self_attention.linear_qkv":
            names = [f"self_attn.{p}_proj" for p in "qkv"]
            parts = [t] * 3 if factor == "lora_a" else _qkv_to_hf(t, dims)
        elif module == "self_attention.linear_proj":
            names, parts = ["self_attn.o_proj"], [t]
        elif fc == "linear_fc1":
            names = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
            parts = [t, t] if factor == "lora_a" else list(torch.chunk(t, 2, dim=0))
        elif fc == "linear_fc2":
            names, parts = [f"{mlp}.down_proj"], [t]
        else:
            raise ValueError(f"adapter tensor {name!r} has no PEFT name")
        for n, p in zip(names, parts, strict=True):
            out[f"{pre}.{layer}.{n}.{ab}.weight"] = p.contiguous().clone()
    return out


def peft_config(settings: LoraSettings, base: str | None, state: dict) -> dict:
    """adapter_config.json contents for the exported adapter."""
    modules = sorted({k.split(".")[-3] for k in state})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank,
            "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "base_model_name_or_path": base, "inference_mode": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}}


def write_peft_adapter(out_dir: str | os.PathLike, full: dict[str, torch.Tensor], dims,
                       settings: LoraSettings, base: str | None,
                       dtype: torch.dtype = torch.float32) -> Path:
    """Write a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(dtype) for k, v in peft_state_dict(full, dims).items()}
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(
        json.dumps(peft_config(settings, base, state), indent=2) + "\n")
    return out
