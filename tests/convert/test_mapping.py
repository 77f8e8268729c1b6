"""Pure name/layout mapping: HF -> full Megatron-Core state dict -> HF, bit for bit."""

import pytest
import torch

from megatron_gspo.convert import ConversionError, get_adapter, padded_vocab_size
from megatron_gspo.convert.param_map import from_te_name
from megatron_gspo.convert.hf_io import HFCheckpointReader
from megatron_gspo.convert.sharding import shard_state_dict, tp_shard, tp_unshard
from tests.convert.tiny_models import ARCHS


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("spec", ["local", "te"])
def test_roundtrip_bit_exact(tiny_hf, arch, spec):
    reader = HFCheckpointReader(tiny_hf[arch])
    adapter = get_adapter(reader.config)
    dims = adapter.dims(reader.config)
    padded = padded_vocab_size(dims.vocab_size, 128, 2)
    mc = adapter.hf_to_mcore(reader.get, dims, padded, spec=spec)
    emb = mc["embedding.word_embeddings.weight"]
    assert emb.shape == (padded, dims.hidden_size)
    assert torch.count_nonzero(emb[dims.vocab_size :]) == 0
    if spec == "te":
        assert all(".input_layernorm." not in k for k in mc)
        assert all(from_te_name(k) in adapter.maps_by_mcore(dims) for k in mc)
    back = adapter.mcore_to_hf(mc, dims, spec=spec)
    assert sorted(back) == sorted(reader.keys())
    for k, v in back.items():
        ref = reader.get(k)
        assert v.dtype == ref.dtype and torch.equal(v, ref), k


def test_qkv_interleaving_matches_group_layout(tiny_hf):
    reader = HFCheckpointReader(tiny_hf["Qwen3ForCausalLM"])
    adapter = get_adapter(reader.config)
    d = adapter.dims(reader.config)
    mc = adapter.hf_to_mcore(reader.get, d, 128)
    qkv = mc["decoder.layers.0.self_attention.linear_qkv.weight"]
    q = reader.get("model.layers.0.self_attn.q_proj.weight")
    k = reader.get("model.layers.0.self_attn.k_proj.weight")
    hd, hpg = d.head_dim, d.heads_per_group
    block = (hpg + 2) * hd
    # group 1: query heads 2,3 then k head 1
    g1 = qkv[block : 2 * block]
    assert torch.equal(g1[: hpg * hd], q[hpg * hd : 2 * hpg * hd])
    assert torch.equal(g1[hpg * hd : hpg * hd + hd], k[hd : 2 * hd])


def test_moe_names_and_router(tiny_hf):
    reader = HFCheckpointReader(tiny_hf["Qwen3MoeForCausalLM"])
    adapter = get_adapter(reader.config)
    d = adapter.dims(reader.config)
    assert d.num_experts == 4
    mc = adapter.hf_to_mcore(reader.get, d, 128, spec="te")
    assert torch.equal(
        mc["decoder.layers.1.mlp.router.weight"], reader.get("model.layers.1.mlp.gate.weight")
    )
    fc1 = mc["decoder.layers.1.mlp.experts.linear_fc1.weight3"]
    assert torch.equal(fc1[:16], reader.get("model.layers.1.mlp.experts.3.gate_proj.weight"))
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in mc


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_tp_pp_ep_shards_reassemble(tiny_hf, arch):
    reader = HFCheckpointReader(tiny_hf[arch])
    adapter = get_adapter(reader.config)
    d = adapter.dims(reader.config)
    maps = adapter.maps_by_mcore(d)
    full = adapter.hf_to_mcore(reader.get, d, 128)
    ep_size = 2 if d.num_experts else 1
    rebuilt: dict[str, list] = {}
    for pp in range(2):
        for ep in range(ep_size):
            for tp in range(2):
                local = shard_state_dict(
                    full,
                    maps,
                    tp=(tp, 2),
                    pp=(pp, 2),
                    ep=(ep, ep_size),
                    num_layers=d.num_layers,
                    num_experts=d.num_experts,
                )
                for name, t in local.items():
                    g = name.replace("decoder.layers.0.", f"decoder.layers.{2 * pp}.")
                    g = g.replace("decoder.layers.1.", f"decoder.layers.{2 * pp + 1}.")
                    if ".local_experts." in g:
                        e = int(g.split(".local_experts.")[1].split(".")[0])
                        g = g.replace(f".local_experts.{e}.", f".local_experts.{e + 2 * ep}.")
                    if (ep == 0 or maps[g].expert) and (tp == 0 or maps[g].tp_dim is not None):
                        rebuilt.setdefault(g, []).append(t)
    assert sorted(rebuilt) == sorted(full)
    for name, shards in rebuilt.items():
        pm = maps[name]
        if pm.tp_dim is None:
            assert all(torch.equal(s, full[name]) for s in shards)
        else:
            assert torch.equal(tp_unshard(shards, pm), full[name]), name


def test_glu_shard_holds_gate_and_up_halves():
    from megatron_gspo.convert.param_map import ParamMap

    pm = ParamMap("x.linear_fc1.weight", ("g", "u"), "glu", 0)
    full = torch.arange(8.0).reshape(8, 1)  # gate rows 0..3, up rows 4..7
    assert tp_shard(full, pm, 1, 2).flatten().tolist() == [2, 3, 6, 7]


def test_unknown_architecture_lists_supported():
    with pytest.raises(ConversionError, match="supported: .*Qwen3MoeForCausalLM"):
        get_adapter({"architectures": ["MistralForCausalLM"]})
    with pytest.raises(ConversionError, match="unsupported"):
        get_adapter({"architectures": ["Qwen3ForCausalLMX"], "model_type": "qwen3"})


def test_missing_and_mismatched_tensor_named(tiny_hf, tmp_path):
    import shutil

    from safetensors.torch import save_file

    src = HFCheckpointReader(tiny_hf["LlamaForCausalLM"])
    missing = "model.layers.2.mlp.up_proj.weight"
    save_file({k: src.get(k) for k in src if k != missing}, str(tmp_path / "model.safetensors"))
    shutil.copy(tiny_hf["LlamaForCausalLM"] / "config.json", tmp_path)
    reader = HFCheckpointReader(tmp_path)
    adapter = get_adapter(reader.config)
    d = adapter.dims(reader.config)
    with pytest.raises(ConversionError, match=f"no tensor '{missing}'"):
        adapter.hf_to_mcore(reader.get, d, 128)

    def bad(n):
        t = src.get(n)
        return t[:-1] if n == "model.layers.1.self_attn.o_proj.weight" else t

    with pytest.raises(ConversionError, match="'model.layers.1.self_attn.o_proj.weight' has shape"):
        adapter.hf_to_mcore(bad, d, 128)


def test_corrupt_safetensors_is_a_clear_error(tiny_hf, tmp_path):
    import shutil

    shutil.copy(tiny_hf["Qwen3ForCausalLM"] / "config.json", tmp_path)
    data = (tiny_hf["Qwen3ForCausalLM"] / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:50] + b"garbage" + data[57:1000])
    with pytest.raises(ConversionError, match="corrupt safetensors file"):
        HFCheckpointReader(tmp_path)
