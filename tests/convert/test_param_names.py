"""Local parameter names of a pipeline stage / expert-parallel rank -> canonical global names,
for both the local and the Transformer Engine spelling (no Megatron process groups needed)."""

import pytest
import torch
from torch import nn

from megatron_gspo.convert import ConversionError, dims_from_hf_config, get_adapter
from megatron_gspo.megatron.io import dist_checkpoint as cio

CFG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "num_hidden_layers": 4,
    "intermediate_size": 16,
    "moe_intermediate_size": 4,
    "num_local_experts": 4,
    "vocab_size": 10,
    "tie_word_embeddings": False,
}


def _p(*shape):
    return nn.Parameter(torch.zeros(shape))


class _Experts(nn.Module):
    def __init__(self, te: bool):
        super().__init__()
        self.num_local_experts = 2
        if te:  # TEGroupedMLP
            self.linear_fc1 = nn.Module()
            self.linear_fc2 = nn.Module()
            for j in range(2):
                self.linear_fc1.register_parameter(f"weight{j}", _p(8, 8))
                self.linear_fc2.register_parameter(f"weight{j}", _p(8, 4))
        else:  # SequentialMLP
            self.local_experts = nn.ModuleList()
            for _ in range(2):
                e = nn.Module()
                e.linear_fc1 = nn.Linear(8, 8, bias=False)
                e.linear_fc2 = nn.Linear(4, 8, bias=False)
                self.local_experts.append(e)


class _Layer(nn.Module):
    def __init__(self, number: int, te: bool):
        super().__init__()
        self.layer_number = number
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = nn.Linear(8, 16, bias=False)
        if te:
            self.self_attention.linear_qkv.layer_norm_weight = _p(8)
        else:
            self.input_layernorm = nn.Module()
            self.input_layernorm.weight = _p(8)
        self.mlp = nn.Module()
        self.mlp.experts = _Experts(te)


class _Stage(nn.Module):
    """Last pipeline stage holding global layers 2 and 3."""

    def __init__(self, te: bool):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([_Layer(3, te), _Layer(4, te)])
        self.output_layer = nn.Linear(8, 10, bias=False)


@pytest.mark.parametrize("te", [False, True])
def test_stage_and_expert_offsets(monkeypatch, te):
    monkeypatch.setattr(cio, "_ep_rank", lambda: 1)
    adapter = get_adapter(CFG)
    maps = adapter.maps_by_mcore(dims_from_hf_config(CFG))
    names = {e.local: e.canonical for e in cio.model_param_entries(_Stage(te), maps, tied=False)}
    assert names["output_layer.weight"] == "output_layer.weight"
    norm = (
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
        if te
        else "decoder.layers.1.input_layernorm.weight"
    )
    assert names[norm] == "decoder.layers.3.input_layernorm.weight"
    fc1 = (
        "decoder.layers.0.mlp.experts.linear_fc1.weight1"
        if te
        else "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    )
    assert names[fc1] == "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"


def test_unmapped_parameter_is_named(monkeypatch):
    monkeypatch.setattr(cio, "_ep_rank", lambda: 0)
    stage = _Stage(False)
    stage.decoder.layers[0].self_attention.extra = nn.Linear(2, 2, bias=False)
    maps = get_adapter(CFG).maps_by_mcore(dims_from_hf_config(CFG))
    with pytest.raises(ConversionError, match="'decoder.layers.0.self_attention.extra.weight'"):
        cio.model_param_entries(stage, maps, tied=False)
