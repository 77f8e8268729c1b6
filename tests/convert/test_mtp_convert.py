"""Multi-token-prediction layers of DeepSeek-V3 / GLM-4.5 checkpoints (issue 55, item 2):
kept by the conversion, both ways, bit for bit, under Megatron-Core's MTP names.

Before this change the adapters had no map for ``model.layers.{num_hidden_layers}.*``:
`validate_hf_checkpoint` refused such a checkpoint (measured on the previous commit, 05d36f9:
"tensor 'model.layers.4.eh_proj.weight' in ... is not mapped for DeepseekV3ForCausalLM", every
test here failing), and the learner's loader, which reads only mapped tensors, dropped them.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.convert import get_adapter
from megatron_gspo.convert.param_map import ConversionError
from megatron_gspo.convert.hf_io import HFCheckpointReader, validate_hf_checkpoint
from megatron_gspo.convert.sharding import tp_shard, tp_unshard
from tests.convert.tiny_families import make_family_model
from tests.convert.tiny_mtp import make_mtp_checkpoint

ARCHS = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_mcore_hf_roundtrip_keeps_mtp_layer_bit_exact(arch, tmp_path):
    sd = make_mtp_checkpoint(arch, tmp_path)
    reader = HFCheckpointReader(tmp_path)
    assert reader.config["num_nextn_predict_layers"] == 1
    adapter = get_adapter(reader.config)
    dims = adapter.dims(reader.config)
    validate_hf_checkpoint(reader, adapter, dims)  # every tensor mapped, shapes as expected
    mc = adapter.hf_to_mcore(reader.get, dims, 256)
    mtp = sorted(k for k in mc if k.startswith("mtp.layers.0."))
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight",
              "transformer_layer.input_layernorm.weight",
              "transformer_layer.mlp.router.expert_bias",
              "transformer_layer.mlp.experts.local_experts.7.linear_fc2.weight",
              "transformer_layer.mlp.shared_experts.linear_fc1.weight"):
        assert "mtp.layers.0." + k in mtp, k
    n = dims.num_layers
    assert torch.equal(mc["mtp.layers.0.eh_proj.weight"], sd[f"model.layers.{n}.eh_proj.weight"])
    back = adapter.mcore_to_hf(mc, dims)
    assert sorted(back) == sorted(sd)
    bad = [k for k in sd if back[k].dtype != sd[k].dtype or not torch.equal(back[k], sd[k])]
    assert not bad, bad


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_tensors_split_and_rejoin_under_tp2_and_tp4(arch, tmp_path):
    make_mtp_checkpoint(arch, tmp_path)
    reader = HFCheckpointReader(tmp_path)
    adapter = get_adapter(reader.config)
    dims = adapter.dims(reader.config)
    mc = adapter.hf_to_mcore(reader.get, dims, 256)
    maps = adapter.maps_by_mcore(dims)
    assert maps["mtp.layers.0.eh_proj.weight"].tp_dim == 0  # ColumnParallelLinear
    for name in (k for k in mc if k.startswith("mtp.")):
        pm = maps[name]
        for size in (2, 4):
            if pm.tp_dim is not None and mc[name].shape[pm.tp_dim] % size:
                continue
            shards = [tp_shard(mc[name], pm, r, size) for r in range(size)]
            assert torch.equal(tp_unshard(shards, pm), mc[name]), name


def test_transformers_saved_checkpoint_declares_an_mtp_layer_it_does_not_have(tmp_path):
    """transformers writes num_nextn_predict_layers=1 and no MTP tensor: the reader counts 0."""
    model = make_family_model("DeepseekV3ForCausalLM", tmp_path)
    assert model.config.num_nextn_predict_layers == 1
    reader = HFCheckpointReader(tmp_path)
    assert reader.config["num_nextn_predict_layers"] == 0
    adapter = get_adapter(reader.config)
    dims = adapter.dims(reader.config)
    validate_hf_checkpoint(reader, adapter, dims)
    assert not any("mtp" in pm.mcore for pm in adapter.param_maps(dims))


def test_mtp_copy_of_the_head_that_differs_is_refused(tmp_path):
    from safetensors.torch import save_file

    sd = make_mtp_checkpoint("DeepseekV3ForCausalLM", tmp_path)
    sd["model.layers.4.shared_head.head.weight"] = sd["lm_head.weight"] + 1e-3
    save_file(sd, str(tmp_path / "model.safetensors"))
    reader = HFCheckpointReader(tmp_path)
    adapter = get_adapter(reader.config)
    with pytest.raises(ConversionError, match="shared_head.head.weight' differs from 'lm_head"):
        adapter.hf_to_mcore(reader.get, adapter.dims(reader.config), 256)


def test_partial_mtp_layer_is_refused_naming_the_missing_tensor(tmp_path):
    from safetensors.torch import save_file

    sd = make_mtp_checkpoint("Glm4MoeForCausalLM", tmp_path)
    del sd["model.layers.4.hnorm.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    reader = HFCheckpointReader(tmp_path)
    adapter = get_adapter(reader.config)
    with pytest.raises(ConversionError, match="model.layers.4.hnorm.weight"):
        validate_hf_checkpoint(reader, adapter, adapter.dims(reader.config))
