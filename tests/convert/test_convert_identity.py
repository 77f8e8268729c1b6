"""`mcore-to-hf --hf-config DIR` must describe the model the checkpoint was written from: its
context length and special token ids, its tokenizer files and (when DIR holds weights) its
weights, compared with what the checkpoint records (`convert.sources.other_model`)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.convert.param_map import ConversionError
from megatron_gspo.convert.sources import (CheckpointSource, other_model, tokenizer_fingerprint,
                                           weights_fingerprint, write_model_info)
from megatron_gspo.megatron.io.conversion import check_mcore_to_hf

ROOT = Path(__file__).resolve().parents[2]
ARCH = "Qwen3ForCausalLM"
OTHER_TOKENIZER = ROOT / "examples" / "tiny" / "base"  # another model's tokenizer files


@pytest.fixture(scope="module")
def converted(tiny_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("identity") / "mc"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"),
                        "hf-to-mcore", "--hf", str(tiny_hf[ARCH]), "--out", str(out),
                        "--no-progress"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _copy(src: Path, dst: Path, weights: bool = True) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if weights or not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    return dst


def _refused(ckpt, hf_dir, tmp_path, match):
    with pytest.raises(ConversionError, match=match) as e:
        check_mcore_to_hf(str(ckpt), str(hf_dir), str(tmp_path / "out"), False)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_the_model_it_was_converted_from_is_accepted(converted, tiny_hf, tmp_path):
    meta = json.loads((converted / "megatron_gspo_checkpoint.json").read_text())
    assert meta["source_fingerprint"] == weights_fingerprint(tiny_hf[ARCH])
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(tiny_hf[ARCH]) is not None
    check_mcore_to_hf(str(converted), str(tiny_hf[ARCH]), str(tmp_path / "a"), False)
    same = _copy(tiny_hf[ARCH], tmp_path / "copy")  # a copy of it: the same fingerprints
    check_mcore_to_hf(str(converted), str(same), str(tmp_path / "b"), False)
    bare = _copy(tiny_hf[ARCH], tmp_path / "bare", weights=False)  # config + tokenizer only
    check_mcore_to_hf(str(converted), str(bare), str(tmp_path / "c"), False)


def test_another_tokenizer_or_context_or_weights_is_refused(converted, tiny_hf, tmp_path):
    d = _copy(tiny_hf[ARCH], tmp_path / "tok", weights=False)
    for f in d.iterdir():
        if f.name.startswith("tokenizer"):
            f.unlink()
    for f in OTHER_TOKENIZER.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy2(f, d / f.name)
    _refused(converted, d, tmp_path, r"tokenizer files differ from the ones of .*, the model the "
             r"checkpoint was written from")
    d = _copy(tiny_hf[ARCH], tmp_path / "ctx", weights=False)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 4 * int(cfg.get("max_position_embeddings") or 512)
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(converted, d, tmp_path, r"config.json differs from the checkpoint's "
             r"\(max_position_embeddings: ")
    d = _copy(tiny_hf[ARCH], tmp_path / "w")
    weights = next(d.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-8:] = bytes(8)  # the same architecture and tokenizer, other weights
    weights.write_bytes(bytes(raw))
    _refused(converted, d, tmp_path, r"holds other weights than .*, which the checkpoint was "
             r"trained from")


def test_checkpoints_that_record_no_tokenizer_compare_with_their_copy(converted, tiny_hf,
                                                                      tmp_path):
    """A checkpoint written before tokenizer fingerprints were recorded: a converted one
    compares with its own copy of the tokenizer (hf_config/); a run checkpoint with the run's
    model.path."""
    old = tmp_path / "old"
    shutil.copytree(converted, old)
    meta_file = old / "megatron_gspo_checkpoint.json"
    meta = json.loads(meta_file.read_text())
    del meta["tokenizer_fingerprint"], meta["source_fingerprint"]
    meta_file.write_text(json.dumps(meta))
    d = _copy(tiny_hf[ARCH], tmp_path / "tok", weights=False)
    (d / "tokenizer_config.json").write_text("{}")
    _refused(old, d, tmp_path, "tokenizer files differ")
    # a run checkpoint's model info (write_model_info records the source's fingerprints)
    run_info = tmp_path / "model"
    run_info.mkdir()
    cfg = json.loads((tiny_hf[ARCH] / "config.json").read_text())
    write_model_info(run_info, cfg, "float32", tiny_hf[ARCH])
    info = json.loads((run_info / "megatron_gspo_model.json").read_text())
    src = CheckpointSource("run", tmp_path, run_info, cfg, None, "float32",
                           recorded={k: info[k] for k in ("source", "source_fingerprint",
                                                          "tokenizer_fingerprint")})
    assert other_model(tiny_hf[ARCH], cfg, src) is None
    assert "tokenizer files differ" in other_model(d, cfg, src)
