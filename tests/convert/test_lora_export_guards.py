"""`convert lora-to-peft` never writes into what it reads, and never names another base
(issue 43 items 2 and 6).

One real LoRA run checkpoint of the tiny Qwen3 model (tests/convert/_lora_ckpt_worker.py,
one process, ~10 s). Refused in one line, with every input left as it was: an --out or
--merged that is, contains or lies inside the checkpoint, its run dir or the base (also with
--force); --out and --merged overlapping; a --base whose weights are not the base lora.json
records. A forced --out is replaced as a whole (no old file left beside the new adapter).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from convert_checkpoint import main  # noqa: E402

ARCH = "Qwen3ForCausalLM"
STEP = "checkpoints/step_00000001"


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def lora_run(tiny_hf, tmp_path_factory):
    """(run dir, base dir) of a LoRA run checkpoint (lora.json names the base)."""
    work = tmp_path_factory.mktemp("lora_run")
    base = work / "base"
    shutil.copytree(tiny_hf[ARCH], base)
    run = work / "run"
    p = subprocess.run([sys.executable, "-W", "ignore",
                        str(Path(__file__).with_name("_lora_ckpt_worker.py")), str(base),
                        str(run)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    (run / "config.yaml").write_text(f"model:\n  path: {base}\n")
    return run, base


def _run(capsys, *argv):
    rc = main(["lora-to-peft", *argv])
    return rc, capsys.readouterr().err.strip()


CASES = {  # name: arguments (RUN, BASE, OTHER: a fresh directory)
    "merged_is_the_run_dir": ["--merged", "RUN", "--force"],
    "merged_is_the_base": ["--merged", "BASE", "--base", "BASE", "--force"],
    "merged_is_the_recorded_base": ["--merged", "BASE", "--force"],
    "out_is_the_run_dir": ["--out", "RUN"],
    "out_inside_the_checkpoint": ["--out", f"RUN/{STEP}/model"],
    "out_inside_the_run_dir": ["--out", "RUN/peft", "--force"],
    "out_contains_the_base": ["--out", "BASE/..", "--force"],
    "out_is_merged": ["--out", "OTHER", "--merged", "OTHER", "--force"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_over_the_checkpoint_run_or_base_are_refused(lora_run, tmp_path, capsys, case):
    run, base = lora_run
    names = {"RUN": str(run), "BASE": str(base), "OTHER": str(tmp_path / "x")}
    args = [names.get(a.split("/")[0], "") + a[len(a.split("/")[0]):]
            if a.split("/")[0] in names else a for a in CASES[case]]
    before = (_snapshot(run), _snapshot(base))
    rc, err = _run(capsys, "--ckpt", str(run / STEP), *args)
    assert rc == 1 and len(err.splitlines()) == 1, err
    flag = "--merged" if case.startswith("merged") or case == "out_is_merged" else "--out"
    assert err.startswith(f"convert_checkpoint: error: {flag} "), err
    assert (_snapshot(run), _snapshot(base)) == before  # nothing read was touched
    assert not (tmp_path / "x").exists() and not (run / "peft").exists()


def _other_weights(base: Path, dst: Path) -> Path:
    """A copy of `base` with one weight changed (same config, same file names)."""
    shutil.copytree(base, dst)
    f = dst / "model.safetensors"
    state = load_file(f)
    key = sorted(state)[0]
    state[key] = state[key] + 0.5
    save_file(state, f, metadata={"format": "pt"})
    return dst


def test_a_base_with_other_weights_is_refused(lora_run, tmp_path, capsys):
    run, base = lora_run
    other = _other_weights(base, tmp_path / "other")
    rc, err = _run(capsys, "--ckpt", str(run / STEP), "--base", str(other), "--out",
                   str(tmp_path / "peft"))
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert "--base" in err and str(other) in err and "lora.json" in err, err
    assert not (tmp_path / "peft").exists()

    # lora.json of an older version (no fingerprint): the recorded base directory's weights
    # are compared
    from megatron_gspo.megatron.io import lora_to_peft as lora_export
    from megatron_gspo.megatron.lora.io import base_mismatch, read_adapter_info

    info = read_adapter_info(run / STEP / "model")
    info.pop("base_fingerprint")
    assert "other weights" in base_mismatch(info, other)
    assert base_mismatch(info, base) is None
    # a copy of the recorded base is the same base
    same = tmp_path / "same"
    shutil.copytree(base, same)
    plan = lora_export.check_lora_to_peft(str(run / STEP), str(same), str(tmp_path / "p"),
                                          None, False)
    assert plan["base"] == str(same)


def test_forced_out_is_replaced_as_a_whole(lora_run, tmp_path, capsys):
    run, _ = lora_run
    out = tmp_path / "peft"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export")
    rc, err = _run(capsys, "--ckpt", str(run / STEP), "--out", str(out), "--force")
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                     "adapter_model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
