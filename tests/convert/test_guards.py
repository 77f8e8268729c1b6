"""The converter never destroys its input and never writes a model its config does not describe.

- `--out` equal to, inside, or containing an input (also through a symlink) is refused with one
  line even with `--force`, and the input is left as it was.
- `mcore-to-hf --hf-config` is checked against the config stored with the checkpoint and against
  the checkpoint's tensor shapes; a mismatch is refused naming the field(s).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from convert_checkpoint import main  # noqa: E402

from megatron_gspo.convert.param_map import ConversionError  # noqa: E402
from megatron_gspo.megatron.io import conversion as conv  # noqa: E402

ARCH = "Qwen3ForCausalLM"


def _run(capsys, *argv):
    rc = main([*argv, "--no-progress"])
    err = capsys.readouterr().err.strip()
    return rc, err


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def mcore_ckpt(tiny_hf, tmp_path_factory):
    """A real converted checkpoint of the tiny Qwen3 model (one Megatron process, ~8 s)."""
    out = tmp_path_factory.mktemp("guards") / "ck"
    p = subprocess.run(
        [sys.executable, "-W", "ignore", str(ROOT / "tools" / "convert_checkpoint.py"),
         "hf-to-mcore", "--hf", str(tiny_hf[ARCH]), "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return out


# ----------------------------------------------------------------------------- --out vs input


@pytest.mark.parametrize("where", ["same", "symlink", "parent", "inside"])
def test_hf_to_mcore_out_overlapping_input_is_refused(tiny_hf, tmp_path, capsys, where):
    src = tmp_path / "models" / "m"
    shutil.copytree(tiny_hf[ARCH], src)
    before = _snapshot(src)
    out = {"same": src, "parent": src.parent, "inside": src / "mcore"}.get(where)
    if where == "symlink":
        out = tmp_path / "link"
        out.symlink_to(src, target_is_directory=True)
    rc, err = _run(capsys, "hf-to-mcore", "--hf", str(src), "--out", str(out), "--force")
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert "--out" in err and "--hf" in err, err
    assert _snapshot(src) == before  # the input is untouched
    assert not (src / "mcore").exists()


@pytest.mark.parametrize("where", ["ckpt", "hf_config", "parent", "inside"])
def test_mcore_to_hf_out_overlapping_input_is_refused(mcore_ckpt, tiny_hf, tmp_path, capsys,
                                                      where):
    ck = tmp_path / "runs" / "ck"
    shutil.copytree(mcore_ckpt, ck)
    cfg = tmp_path / "cfg"
    shutil.copytree(tiny_hf[ARCH], cfg)
    before = (_snapshot(ck), _snapshot(cfg))
    out = {"ckpt": ck, "hf_config": cfg, "parent": ck.parent, "inside": ck / "hf"}[where]
    rc, err = _run(capsys, "mcore-to-hf", "--ckpt", str(ck), "--hf-config", str(cfg),
                   "--out", str(out), "--force")
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert "--out" in err, err
    assert (_snapshot(ck), _snapshot(cfg)) == before


def test_mcore_to_hf_existing_out_needs_force(mcore_ckpt, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc, err = _run(capsys, "mcore-to-hf", "--ckpt", str(mcore_ckpt), "--out", str(out))
    assert rc == 1 and "output directory" in err and "--force" in err, err
    assert (out / "keep.txt").read_text() == "x"


# ----------------------------------------------------------------------------- --hf-config


def _edited_config(tiny_hf, tmp_path, **edits) -> Path:
    d = tmp_path / "cfg"
    shutil.copytree(tiny_hf[ARCH], d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in edits.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


MISMATCHES = {
    "tie_word_embeddings": {"tie_word_embeddings": True},
    "num_hidden_layers": {"num_hidden_layers": 3},
    "rms_norm_eps": {"rms_norm_eps": 1e-5},
    "rope_theta": {"rope_theta": 12345.0, "rope_parameters": {"rope_type": "default",
                                                              "rope_theta": 12345.0}},
    "hidden_size": {"hidden_size": 48},
    "num_attention_heads": {"num_attention_heads": 2, "num_key_value_heads": 2},
    "vocab_size": {"vocab_size": 120},  # same padded rows: only the stored config tells
    "intermediate_size": {"intermediate_size": 64},
}


@pytest.mark.parametrize("field", list(MISMATCHES))
def test_mismatched_hf_config_is_refused(mcore_ckpt, tiny_hf, tmp_path, capsys, field):
    cfg = _edited_config(tiny_hf, tmp_path, **MISMATCHES[field])
    out = tmp_path / "o"
    rc, err = _run(capsys, "mcore-to-hf", "--ckpt", str(mcore_ckpt), "--hf-config", str(cfg),
                   "--out", str(out))
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert field in err, err
    assert not out.exists()


@pytest.mark.parametrize("field", ["tie_word_embeddings", "num_hidden_layers", "hidden_size",
                                   "intermediate_size"])
def test_mismatch_found_from_tensor_shapes_alone(mcore_ckpt, tiny_hf, tmp_path, capsys, field):
    """Without a stored config (deleted) the checkpoint's tensor shapes still catch it."""
    ck = tmp_path / "ck"
    shutil.copytree(mcore_ckpt, ck)
    shutil.rmtree(ck / "hf_config")
    cfg = _edited_config(tiny_hf, tmp_path, **MISMATCHES[field])
    with pytest.raises(ConversionError, match=field):
        conv.check_mcore_to_hf(str(ck), str(cfg), str(tmp_path / "o"), False)


def test_matching_hf_config_with_other_metadata_is_accepted(mcore_ckpt, tiny_hf, tmp_path):
    """Fields that do not change the computed function (dtype, versions) may differ, and
    defaults may be spelled out or left out. (The context length is the model's identity:
    tests/convert/test_convert_identity.py.)"""
    cfg = _edited_config(tiny_hf, tmp_path, torch_dtype="bfloat16", transformers_version="9.9",
                         bos_token_id=None, architectures=None,
                         rope_parameters=None, rope_theta=10000, attention_bias=None)
    plan = conv.check_mcore_to_hf(str(mcore_ckpt), str(cfg), str(tmp_path / "o"), False)
    assert plan["side_dir"] == str(cfg) and plan["write_config"] is None
