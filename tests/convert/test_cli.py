"""Bad input to tools/convert_checkpoint.py: one-line errors, exit code 1, no output left."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_gspo.convert.param_map import ConversionError
from megatron_gspo.convert.hf_io import INDEX_NAME, save_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from convert_checkpoint import main  # noqa: E402


def _copy_model(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        sd = load_file(dst / "model.safetensors")
        edit(sd)
        save_file(sd, str(dst / "model.safetensors"))
    return dst


def _run(capsys, *argv):
    rc = main(list(argv))
    err = capsys.readouterr().err.strip()
    return rc, err


def test_unknown_architecture(tiny_hf, tmp_path, capsys):
    d = _copy_model(tiny_hf["Qwen3ForCausalLM"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    rc, err = _run(capsys, "hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "o"))
    assert rc == 1 and "MistralForCausalLM" in err and "Qwen3MoeForCausalLM" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


def test_missing_tensor_named(tiny_hf, tmp_path, capsys):
    d = _copy_model(
        tiny_hf["LlamaForCausalLM"],
        tmp_path / "m",
        lambda sd: sd.pop("model.layers.3.self_attn.k_proj.weight"),
    )
    rc, err = _run(capsys, "hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "o"))
    assert rc == 1 and "'model.layers.3.self_attn.k_proj.weight'" in err
    assert not (tmp_path / "o").exists()


def test_shape_mismatch_named(tiny_hf, tmp_path, capsys):
    def edit(sd):
        sd["model.layers.0.mlp.experts.2.down_proj.weight"] = torch.zeros(3, 3)

    d = _copy_model(tiny_hf["Qwen3MoeForCausalLM"], tmp_path / "m", edit)
    rc, err = _run(capsys, "hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "o"))
    assert rc == 1 and "'model.layers.0.mlp.experts.2.down_proj.weight' has shape (3, 3)" in err


def test_unmapped_tensor_named(tiny_hf, tmp_path, capsys):
    def edit(sd):
        sd["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)

    d = _copy_model(tiny_hf["Qwen3ForCausalLM"], tmp_path / "m", edit)
    rc, err = _run(capsys, "hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "o"))
    assert rc == 1 and "'model.layers.0.self_attn.o_proj.bias'" in err


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_corrupt_safetensors(tiny_hf, tmp_path, capsys, damage):
    d = _copy_model(tiny_hf["Qwen2ForCausalLM"], tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(b"\xff" * 16 + data[16:] if damage == "header" else data[: len(data) // 2])
    rc, err = _run(capsys, "hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "o"))
    assert rc == 1 and "corrupt safetensors file" in err and not (tmp_path / "o").exists()


def test_output_exists_is_refused(tiny_hf, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc, err = _run(
        capsys, "hf-to-mcore", "--hf", str(tiny_hf["Qwen3ForCausalLM"]), "--out", str(out)
    )
    assert rc == 1 and "exists" in err and "--force" in err
    assert (out / "keep.txt").read_text() == "x"


def test_mcore_to_hf_rejects_non_checkpoint(tiny_hf, tmp_path, capsys):
    rc, err = _run(
        capsys,
        "mcore-to-hf",
        "--ckpt",
        str(tiny_hf["Qwen3ForCausalLM"]),
        "--out",
        str(tmp_path / "o"),
    )
    assert rc == 1 and "not a megatron_gspo checkpoint" in err


def test_bad_layout_and_dtype(tiny_hf, tmp_path, capsys):
    hf = str(tiny_hf["Qwen3ForCausalLM"])
    rc, err = _run(capsys, "hf-to-mcore", "--hf", hf, "--out", str(tmp_path / "o"), "--tp", "0")
    assert rc == 1 and "--tp" in err
    rc, err = _run(
        capsys, "hf-to-mcore", "--hf", hf, "--out", str(tmp_path / "o"), "--dtype", "fp8"
    )
    assert rc == 1 and "unknown dtype 'fp8'" in err


def test_failed_write_leaves_nothing(tmp_path):
    def items():
        yield "a", torch.zeros(4)
        yield "b", torch.ones(4)
        raise ConversionError("boom")

    with pytest.raises(ConversionError, match="boom"):
        save_hf_checkpoint(items(), tmp_path / "o", side_files_from=None, max_shard_bytes=16)
    assert list(tmp_path.iterdir()) == []


def test_shards_are_bounded_and_indexed(tmp_path):
    tensors = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(6)}  # 4..24 bytes
    index = save_hf_checkpoint(
        tensors.items(), tmp_path / "o", side_files_from=None, max_shard_bytes=32
    )
    files = sorted((tmp_path / "o").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "o" / INDEX_NAME).is_file()
    back = {}
    for f in files:
        assert f.stat().st_size < 32 + 400  # data bound + header
        part = load_file(f)
        assert sum(t.numel() * 4 for t in part.values()) <= 32
        back.update(part)
        assert all(index["weight_map"][k] == f.name for k in part)
    assert all(torch.equal(back[k], v) for k, v in tensors.items()) and len(back) == 6
    with pytest.raises(ConversionError, match="exists"):
        save_hf_checkpoint(tensors.items(), tmp_path / "o", side_files_from=None)
    save_hf_checkpoint([("x", torch.ones(2))], tmp_path / "o", side_files_from=None, force=True)
    names = {p.name for p in (tmp_path / "o").iterdir()}
    assert names == {INDEX_NAME, "model-00001-of-00001.safetensors"}
    assert [p.name for p in tmp_path.iterdir()] == ["o"]  # no temp / old dirs left


def test_exit_code_of_the_process(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "convert_checkpoint.py"),
            "hf-to-mcore",
            "--hf",
            str(tmp_path / "m"),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "unsupported architecture 'GPT2LMHeadModel'" in p.stderr


def test_unwritable_out_is_refused_before_anything_is_loaded(tiny_hf, tmp_path, capsys,
                                                             monkeypatch):
    from megatron_gspo.megatron.io import conversion

    def refuse(*_a, **_k):
        raise AssertionError("the conversion started before --out was checked")

    monkeypatch.setattr(conversion, "launch", refuse)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    outs = [blocker / "o", blocker]
    try:
        (Path("/sys") / "megatron_gspo_probe").mkdir()
    except OSError:
        outs.append(Path("/sys/megatron_gspo_probe/o"))  # a read-only file system
    hf = str(tiny_hf["Qwen3ForCausalLM"])
    for out in outs:
        for argv in (["hf-to-mcore", "--hf", hf], ["mcore-to-hf", "--ckpt", hf]):
            rc, err = _run(capsys, *argv, "--out", str(out), "--force")
            assert rc == 1 and len(err.splitlines()) == 1, (out, err[-2000:])
            assert f"--out {out}" in err and "cannot be written" in err, err


def test_a_checkpoint_being_converted_is_not_rotated_away(tmp_path):
    """The converter holds the run checkpoint it reads (a shared flock on COMPLETE); the
    trainer's rotation keeps a held checkpoint until a later save."""
    from megatron_gspo.runtime.run_checkpoint import Checkpointer, hold_for_reading

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        d = root / f"step_{step:08d}"
        (d / "model").mkdir(parents=True)
        (d / "COMPLETE").write_text("{}")
    ckpt = Checkpointer(root, keep_last=2)
    held = subprocess.Popen([sys.executable, "-c",
                             "import sys, time; from megatron_gspo.runtime.run_checkpoint import "
                             "hold_for_reading\n"
                             f"with hold_for_reading({str(root / 'step_00000001')!r}):"
                             "\n    print('held', flush=True); time.sleep(60)"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "held"
        ckpt.rotate()
        assert (root / "step_00000001" / "COMPLETE").is_file()
        assert any("being read" in e for e in ckpt.events)
    finally:
        held.kill()
        held.wait()
    ckpt.rotate()
    assert [p.name for p in sorted(root.iterdir())] == ["step_00000002", "step_00000003"]
    with pytest.raises(FileNotFoundError):
        with hold_for_reading(root / "step_00000001"):
            pass
