"""HF checkpoint -> block-wise FP8 checkpoint (DeepSeek-V3 format; megatron_gspo/quant/
fp8_checkpoint.py) on tiny transformers models (tests/convert/tiny_models.py): the tensors and
names SGLang loads (`*.weight` e4m3 + `*.weight_scale_inv` fp32), the quantization_config, kept
layers, sharded sources, the dequantized model's logits next to the original's, and one-line
refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from megatron_gspo.quant import blockfp8 as bf
from megatron_gspo.quant.fp8_checkpoint import dequantized_state, write_fp8_checkpoint
from tests.convert.tiny_models import make_tiny_model

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    # q / k / v, gate / up parts of whole 128-row blocks (SGLang fuses them); o / down partial
    model = make_tiny_model("Qwen3ForCausalLM", d / "src", tie_word_embeddings=False,
                            hidden_size=96, head_dim=64, intermediate_size=256)
    (d / "src" / "tokenizer.json").write_text("{}\n")  # a stand-in tokenizer file to copy
    return d, model


def test_qwen3_to_fp8(qwen3):
    d, model = qwen3
    qc = write_fp8_checkpoint(d / "src", d / "fp8", keep_bf16_layers=1)
    src, out = _tensors(d / "src"), _tensors(d / "fp8")
    quantized = {f"model.layers.{i}.{m}.weight" for i in (1, 2) for m in PROJ}
    assert set(out) == set(src) | {bf.scale_name(n) for n in quantized}
    for name, t in src.items():
        if name in quantized:
            q, s = out[name], out[bf.scale_name(name)]
            assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            assert s.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
            rq, rs = bf.quantize(t, name)
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        else:
            assert torch.equal(out[name], t) and out[name].dtype == t.dtype, name
    cfg = json.loads((d / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"] == qc
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme",
                               "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}
    keep = qc["modules_to_not_convert"]
    assert keep == sorted({"lm_head", "model.embed_tokens"}
                          | {f"model.layers.{i}.{m}" for i in (0, 3) for m in PROJ})
    src_cfg = json.loads((d / "src" / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    assert (d / "fp8" / "tokenizer.json").read_text() == "{}\n"
    assert (d / "fp8" / "tokenizer_config.json").is_file()


def test_fused_parts_off_the_block_grid_stay_unquantized(tmp_path):
    make_tiny_model("Qwen3ForCausalLM", tmp_path / "src")  # q 64, k / v 32, gate / up 48 rows
    qc = write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8")
    out = _tensors(tmp_path / "fp8")
    for i in range(4):
        for m in PROJ:
            fused = m.rsplit(".", 1)[1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
            assert (f"model.layers.{i}.{m}" in qc["modules_to_not_convert"]) == fused
            assert (f"model.layers.{i}.{m}.weight_scale_inv" in out) == (not fused)


def test_dequantized_model_tracks_the_original(qwen3, tmp_path):
    import transformers

    d, model = qwen3
    write_fp8_checkpoint(d / "src", tmp_path / "fp8")
    state = dequantized_state(tmp_path / "fp8")
    assert set(state) == set(_tensors(d / "src"))
    deq = transformers.Qwen3ForCausalLM(model.config).eval()
    deq.load_state_dict(state, strict=True)
    ids = torch.tensor([[5, 9, 12, 7, 40, 3, 17, 60]])
    with torch.no_grad():
        a = torch.log_softmax(model(ids).logits.float(), -1)
        b = torch.log_softmax(deq(ids).logits.float(), -1)
    diff = (a - b).abs()
    print(f"\nlog-prob diff original vs FP8-dequantized: max {diff.max():.3g} "
          f"mean {diff.mean():.3g}")
    assert 0 < diff.max() < 0.2 and diff.mean() < 0.03  # the quantization error shows, small


def test_sharded_source_keeps_its_shards(tmp_path):
    model = make_tiny_model("Qwen3MoeForCausalLM", tmp_path / "src", head_dim=64,
                            moe_intermediate_size=128)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    src_index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    assert len(set(src_index["weight_map"].values())) > 2
    for f in tmp_path.joinpath("src").glob("*.safetensors"):
        if f.name not in set(src_index["weight_map"].values()):
            f.unlink()  # the single-file save of make_tiny_model
    qc = write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8")
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())
    out = _tensors(tmp_path / "fp8")
    assert set(index["weight_map"]) == set(out)
    for name, shard in src_index["weight_map"].items():
        assert index["weight_map"][name] == shard
        if bf.scale_name(name) in out:  # the scale lives in its weight's shard
            assert index["weight_map"][bf.scale_name(name)] == shard
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in out.values())
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in out
    assert "model.layers.0.mlp.gate" in qc["modules_to_not_convert"]
    assert out["model.layers.0.mlp.gate.weight"].dtype == torch.float32


def test_refusals_are_one_line(qwen3, tmp_path):
    d, _ = qwen3
    write_fp8_checkpoint(d / "src", tmp_path / "fp8")
    with pytest.raises(ValueError, match=r"config\.json: already quantized \(quantization_"
                       r"config quant_method='fp8'\)"):
        write_fp8_checkpoint(tmp_path / "fp8", tmp_path / "again")
    with pytest.raises(ValueError, match="output directory is not empty"):
        write_fp8_checkpoint(d / "src", tmp_path / "fp8")
    with pytest.raises(ValueError, match="config.json not found"):
        write_fp8_checkpoint(tmp_path / "nowhere", tmp_path / "x")
    with pytest.raises(ValueError, match="keep-bf16-layers must be >= 0"):
        write_fp8_checkpoint(d / "src", tmp_path / "y", keep_bf16_layers=-1)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    from safetensors.torch import save_file

    w = torch.randn(8, 8)
    w[1, 1] = float("nan")
    save_file({"model.layers.1.mlp.down_proj.weight": w}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.mlp\.down_proj\.weight: 1 "
                       r"non-finite values \(1 nan, 0 inf\)"):
        write_fp8_checkpoint(bad, tmp_path / "z")


def test_cli_hf_to_fp8(qwen3, tmp_path, capsys):
    import subprocess
    import sys

    from megatron_gspo.cli.convert import main

    d, _ = qwen3
    out = tmp_path / "fp8"
    assert main(["hf-to-fp8", str(d / "src"), str(out), "--keep-bf16-layers", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in qc["modules_to_not_convert"]
    assert "model.layers.1.self_attn.q_proj" not in qc["modules_to_not_convert"]
    assert main(["hf-to-fp8", str(d / "src"), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists (pass --force to overwrite)" in err
    assert main(["hf-to-fp8", str(d / "src"), str(out), "--force"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["lm_head", "model.embed_tokens"]
    assert main(["hf-to-fp8", str(d / "src"), str(d / "src" / "inner")]) == 1
    assert "DST" in capsys.readouterr().err and not (d / "src" / "inner").exists()
    assert main(["hf-to-fp8", str(out), str(tmp_path / "twice")]) == 1  # already FP8
    assert "already quantized" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]  # no temp dirs left
    p = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "convert", "hf-to-fp8",
                        "--help"], capture_output=True, text=True, check=True)
    assert "--keep-bf16-layers N" in p.stdout
