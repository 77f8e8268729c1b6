"""LoRA checkpoints and exports.

A LoRA run checkpoint's `model/` directory holds the adapters and their optimizer state only
(Megatron `dist_checkpointing`, reshardable) and `lora.json`: the adapter settings and the base
model it was trained on (`base`: `model.path`, or `model.load_checkpoint` when set). The base
weights themselves are read from there on resume and by the export.

The PEFT export (`peft_state_dict`, `write_peft_adapter`) writes `adapter_config.json` +
`adapter_model.safetensors` with PEFT's names for the Hugging Face model
(`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`, ...): the fused QKV
adapter becomes q/k/v adapters sharing A (B cut into the q, k, v rows), the fused [gate; up]
adapter becomes gate_proj/up_proj adapters sharing A.

Routed experts: transformers 5.x stores a layer's experts as two 3-D parameters
(`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj` [E, H, F]: Qwen3-MoE, DeepSeek-V3,
GLM-4.5), and peft (>= 0.17; checked with 0.21.2, tuners/lora/layer.py `ParamWrapper`) adapts
them through `target_parameters`: one wrapper per parameter, A [E*r, in] (expert e's rows
e*r..e*r+r-1) and B [out, r*E] (expert e's column j at j*E + e), wrappers nested in the
module's parameter order (gate_up_proj inner: `mlp.experts.base_layer.lora_*`, down_proj outer:
`mlp.experts.lora_*`). The learner's per-expert [gate; up] / down adapters map onto that exactly.
Shared experts and dense MLP layers of an MoE model are named by their module path
(`shared_experts.gate_proj`, `mlp.gate_proj`), which peft >= 0.22 keeps as `nn.Linear` targets.
Refused in one line (`PeftExportError`): gpt-oss's experts (transposed, interleaved gate/up), an
expert adapter with dropout (peft's ParamWrapper has none), and, where the installed peft is
older than 0.22, adapters on shared experts or dense MLP layers of an MoE model: on load peft
0.21 rewrites every gate_proj / up_proj / down_proj target of these architectures into the
routed experts' fused parameters (utils/transformers_weight_conversion.py
`_convert_peft_config_moe`, model types mapped to qwen2_moe), so such an adapter cannot be
expressed for it.
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


class PeftExportError(ValueError):
    """An adapter PEFT cannot load (the reason in one line)."""


_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\."
                     r"(linear_fc[12])\.(lora_a|lora_b)$")


def _fused_experts(full: dict[str, torch.Tensor], out: dict[str, torch.Tensor], pre: str) -> None:
    """Routed experts' adapters as peft's `ParamWrapper` factors of the 3-D expert parameters."""
    by: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
    for name, t in full.items():
        m = _EXPERT.match(name)
        by.setdefault((int(m.group(1)), m.group(3), m.group(4)), {})[int(m.group(2))] = t
    for (layer, fc, factor), per in sorted(by.items()):
        if sorted(per) != list(range(len(per))):
            raise PeftExportError(f"layer {layer}: expert adapters {sorted(per)} are not 0..E-1")
        ts = [per[e] for e in range(len(per))]
        where = "mlp.experts.base_layer" if fc == "linear_fc1" else "mlp.experts"
        if factor == "lora_a":  # [E*r, in]
            t, ab = torch.cat(ts, dim=0), "lora_A"
        else:  # [out, r, E] -> [out, r*E]: expert e's column j at j*E + e
            t, ab = torch.stack(ts, dim=-1).reshape(ts[0].shape[0], -1), "lora_B"
        out[f"{pre}.{layer}.{where}.{ab}.weight"] = t.contiguous().clone()


def peft_refusal(targets, hf_config: dict, dropout: float = 0.0) -> str | None:
    """Why peft cannot load an adapter of these targets on this HF model (None: it can); the
    cheap check before any weight is read (`peft_state_dict` refuses the same by name)."""
    from megatron_gspo.convert.param_map import num_routed_experts

    arch = (hf_config.get("architectures") or [""])[0]
    moe = num_routed_experts(hf_config) > 0
    if "experts" in targets and arch == "GptOssForCausalLM":
        return ("PEFT export of gpt-oss expert adapters is not supported (transformers' "
                "GptOssExperts: transposed [E, H, 2F] with interleaved gate/up); export --merged")
    if "experts" in targets and dropout:
        return (f"expert adapters with dropout {dropout}: peft's ParamWrapper "
                "(target_parameters) refuses lora_dropout != 0")
    mlp = [t for t in targets if t in ("shared_experts", "fc1", "fc2")]
    old_peft = peft_rewriting_moe_mlp()
    if moe and mlp and old_peft:
        return (f"model.lora.targets {mlp[0]!r}: peft {old_peft} cannot load adapters on shared "
                "experts or dense MLP layers of an MoE model (it rewrites their gate_proj / "
                "up_proj / down_proj targets into the routed experts' fused parameters on load, "
                "transformers_weight_conversion._convert_peft_config_moe); install peft >= 0.22 "
                "or export --merged")
    return None


def peft_rewriting_moe_mlp() -> str | None:
    """The installed peft's version when it is one that rewrites MLP targets of MoE models into
    the routed experts (< 0.22); None for a newer peft or none installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("peft")
    except PackageNotFoundError:
        return None
    major, minor = (int("".join(c for c in x if c.isdigit()) or 0) for x in v.split(".")[:2])
    return v if (major, minor) < (0, 22) else None


def peft_state_dict(full: dict[str, torch.Tensor], dims, arch: str | None = None,
                    dropout: float = 0.0) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors from the learner's full adapter factors.

    Args:
        full: {megatron global name ending in .lora_a / .lora_b: full tensor} (TP=PP=EP=1
            layout, e.g. `weights.gather_full` filtered to adapters).
        dims: `ModelDims` of the HF architecture (head counts for the QKV split).
        arch: the HF architecture (refusals that depend on transformers' expert layout).
        dropout: the adapters' dropout (peft's expert wrapper has none).
    Returns:
        {PEFT name: tensor}; PeftExportError when peft cannot load the adapter.
    """
    from megatron_gspo.convert.param_map import _qkv_to_hf

    out: dict[str, torch.Tensor] = {}
    pre = "base_model.model.model.layers"
    experts = {k: v for k, v in full.items() if _EXPERT.match(k)}
    if experts:
        if arch == "GptOssForCausalLM":
            raise PeftExportError("PEFT export of gpt-oss expert adapters is not supported "
                                  "(transformers' GptOssExperts: transposed [E, H, 2F] with "
                                  "interleaved gate/up); export --merged")
        if dropout:
            raise PeftExportError(f"expert adapters with dropout {dropout}: peft's ParamWrapper "
                                  "(target_parameters) refuses lora_dropout != 0")
        _fused_experts(experts, out, pre)
    for name, t in sorted(full.items()):
        if name in experts:
            continue
        m = _LAYER.match(name)
        if m is None:
            raise ValueError(f"adapter tensor {name!r} has no PEFT name")
        layer, module, factor = int(m.group(1)), m.group(2), m.group(3)
        ab = "lora_A" if factor == "lora_a" else "lora_B"
        mlp = "mlp.shared_experts" if module.startswith("mlp.shared_experts.") else "mlp"
        fc = module.rsplit(".", 1)[-1]
        old_peft = peft_rewriting_moe_mlp()
        if dims.num_experts and fc in ("linear_fc1", "linear_fc2") and old_peft:
            raise PeftExportError(
                f"adapter {name!r}: peft {old_peft} cannot load adapters on shared experts or "
                "dense MLP layers of an MoE model (it rewrites their gate_proj / up_proj / "
                "down_proj targets into the routed experts' fused parameters on load, "
                "transformers_weight_conversion._convert_peft_config_moe); install peft >= "
                "0.22 or export --merged")
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


def peft_config(settings: LoraSettings, base: str | None, state: dict,
                moe: bool = False) -> dict:
    """adapter_config.json contents for the exported adapter (routed experts through
    `target_parameters`, every other layer through `target_modules`; on an MoE model MLP
    targets by their module path, `mlp.gate_proj` / `shared_experts.gate_proj`, which peft
    >= 0.22 leaves on the `nn.Linear` layers)."""
    def target(k: str) -> str:
        parts = k.split(".")
        return ".".join(parts[-4:-2]) if moe and parts[-3].endswith("_proj") and \
            parts[-4] in ("mlp", "shared_experts") else parts[-3]

    modules = sorted({target(k) for k in state if ".mlp.experts." not in k})
    params = (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
              if any(".mlp.experts." in k for k in state) else None)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank,
            "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
            "target_modules": modules, "target_parameters": params, "bias": "none",
            "fan_in_fan_out": False,
            "base_model_name_or_path": base, "inference_mode": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}}


def write_peft_adapter(out_dir: str | os.PathLike, full: dict[str, torch.Tensor], dims,
                       settings: LoraSettings, base: str | None,
                       dtype: torch.dtype = torch.float32, arch: str | None = None) -> Path:
    """Write a PEFT adapter directory (adapter_config.json, adapter_model.safetensors);
    `arch`: the HF architecture (PeftExportError for what peft cannot load)."""
    from safetensors.torch import save_file

    state = {k: v.to(dtype) for k, v in
             peft_state_dict(full, dims, arch, settings.dropout).items()}  # refusals first
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(
        json.dumps(peft_config(settings, base, state, moe=bool(dims.num_experts)), indent=2) + "\n")
    return out
