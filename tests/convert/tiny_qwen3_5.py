"""Tiny random Qwen3.5 text models, dense (Qwen3_5ForCausalLM) and MoE (Qwen3_5MoeForCausalLM),
shaped like transformers' default Qwen3.5 configs (their value in each comment: the MoE default
is the 35B-A3B shape), and a tiny vision-language Qwen3.5-MoE checkpoint written the way the
released ones are (``model.language_model.*``, ``model.visual.*``, fused experts), for the
parity and conversion tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

DENSE, MOE = "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"
QWEN3_5 = {
    "vocab_size": 160,  # 248320
    "hidden_size": 64,  # 4096 (MoE: 2048)
    "intermediate_size": 96,  # 12288 (dense only)
    "num_hidden_layers": 4,  # 32 (MoE: 40)
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # full_attention_interval 4
    "num_attention_heads": 4,  # 16
    "num_key_value_heads": 2,  # 4 (MoE: 2)
    "head_dim": 16,  # 256
    "linear_conv_kernel_dim": 4,  # 4
    "linear_key_head_dim": 8,  # 128
    "linear_value_head_dim": 8,  # 128
    "linear_num_key_heads": 2,  # 16
    "linear_num_value_heads": 4,  # 32
    "rms_norm_eps": 1e-6,  # 1e-6
    "max_position_embeddings": 4096,  # 32768
    "hidden_act": "silu",
    "tie_word_embeddings": False,  # false
    # partial_rotary_factor 0.25 of head_dim 16: 4 rotary dims = 2 * sum(mrope_section)
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                        "mrope_interleaved": True},  # theta 1e7, section [11, 11, 10]
}
EXPERTS = {
    "num_experts": 8,  # 256
    "num_experts_per_tok": 2,  # 8
    "moe_intermediate_size": 16,  # 512
    "shared_expert_intermediate_size": 24,  # 512
}


def text_fields(moe: bool, **changes) -> dict:
    """The tiny text config's fields (no `architectures`)."""
    fields = {k: v for k, v in QWEN3_5.items() if not (moe and k == "intermediate_size")}
    fields = {**fields, **(EXPERTS if moe else {}), **changes}
    fields["rope_parameters"] = dict(fields["rope_parameters"])
    return fields


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    from tests.convert.tiny_families import _perturb

    torch.manual_seed(seed + 1)
    _perturb(model)
    with torch.no_grad():  # gates and decays away from their init, so each one matters
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "shared_expert_gate.weight", "conv1d.weight")):
                p.add_(0.3 * torch.randn_like(p))
    return model


def make_qwen3_5(out_dir: Path, moe: bool, seed: int = 0, **changes) -> torch.nn.Module:
    """Build, perturb and save a tiny random Qwen3.5 text model; returns it (fp32, eval)."""
    cls = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
    cfg = cls(**text_fields(moe, **changes))
    cfg.architectures = [MOE if moe else DENSE]
    torch.manual_seed(seed)
    model = (transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM)(cfg)
    _perturbed(model.eval(), seed)
    model.save_pretrained(out_dir)
    (Path(out_dir) / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return model


def make_released_qwen3_5_moe(out_dir: Path, seed: int = 0) -> torch.nn.Module:
    """A tiny Qwen3_5MoeForConditionalGeneration saved as the released checkpoints are: experts
    fused per layer (``mlp.experts.gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]), one
    ``mtp.*`` tensor beside the vision tower. Returns the model (fp32, eval)."""
    from safetensors.torch import load_file, save_file

    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                  out_hidden_size=QWEN3_5["hidden_size"])
    cfg = transformers.Qwen3_5MoeConfig(text_config=text_fields(True), vision_config=vision)
    torch.manual_seed(seed)
    model = _perturbed(transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval(), seed)
    model.save_pretrained(out_dir)
    path = Path(out_dir) / "model.safetensors"
    sd, fused = load_file(path), {}
    for i in range(QWEN3_5["num_hidden_layers"]):
        p = f"model.language_model.layers.{i}.mlp.experts."
        n = EXPERTS["num_experts"]
        fused[p + "gate_up_proj"] = torch.stack([torch.cat(
            [sd.pop(f"{p}{e}.gate_proj.weight"), sd.pop(f"{p}{e}.up_proj.weight")])
            for e in range(n)])
        fused[p + "down_proj"] = torch.stack([sd.pop(f"{p}{e}.down_proj.weight")
                                              for e in range(n)])
    sd["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file({**sd, **fused}, path, metadata={"format": "pt"})
    return model
