"""`megatron-gspo plan` refuses what training refuses, with training's own checks, and its
flags and model config are one-line errors instead of tracebacks (issue 43, items 10, 11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_gspo.cli import main
from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.loop import early_checks

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "examples" / "qwen3_gpu"
CONFIG = GPU / "qwen3_8b_1node.yaml"  # TP2 + SP on 8 GPUs
SHAPE = json.loads((GPU / "shapes" / "Qwen3-8B" / "config.json").read_text())


def _plan(capsys, *args):
    rc = main(["plan", str(CONFIG), *args])
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    return rc, lines, out.out


def _shape(tmp_path, **changes):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**SHAPE, **changes}))
    return p


@pytest.mark.parametrize("changes,overrides,needle", [
    ({"num_key_value_heads": 1}, [], "num_key_value_heads=1 not divisible by parallel.tensor=2"),
    ({"num_attention_heads": 0}, [], "num_attention_heads=0; expected a positive integer"),
    ({"vocab_size": 0}, [], "vocab_size=0; expected a positive integer"),
    ({}, ["parallel.expert=2"], "parallel.expert=2 but the model has no experts"),
])
def test_a_layout_training_refuses_does_not_fit(capsys, tmp_path, changes, overrides, needle):
    shape = _shape(tmp_path, **changes)
    rc, lines, out = _plan(capsys, "--model-config", str(shape), *overrides)
    assert rc == 2 and len(lines) == 1 and "fits" not in out, (lines, out)
    assert lines[0].startswith("megatron-gspo: config error: ") and needle in lines[0], lines
    # training's start-up check says the same
    with pytest.raises(ConfigError) as e:
        early_checks.check_model_layout(load_config(CONFIG, overrides), {**SHAPE, **changes}, 8,
                                        model=str(shape))
    assert lines[0] == f"megatron-gspo: config error: {e.value}"


@pytest.mark.parametrize("args,needle", [
    (["--nodes", "-1"], "plan: --nodes: expected an integer >= 1, got -1"),
    (["--nodes", "0"], "plan: --nodes: expected an integer >= 1, got 0"),
    (["--gpus-per-node", "0"], "plan: --gpus-per-node: expected an integer >= 1, got 0"),
    (["--gpu-memory", "0"], "plan: --gpu-memory: '0' is no memory"),
    (["--gpu-memory", "9" * 400], "plan: --gpu-memory:"),
    (["--model-config", "/dev/zero"], "plan: model config /dev/zero: more than 16 MiB"),
])
def test_plan_flags_that_cannot_work_are_one_line_errors(capsys, args, needle):
    if "--model-config" not in args:
        args = [*args, "--model-config", str(GPU / "shapes" / "Qwen3-8B")]
    rc, lines, out = _plan(capsys, *args)
    assert rc == 2 and len(lines) == 1 and needle in lines[0], (lines, out)


def test_a_model_config_that_is_a_json_list_is_a_one_line_error(capsys, tmp_path):
    p = tmp_path / "config.json"
    p.write_text("[1, 2]")
    rc, lines, _ = _plan(capsys, "--model-config", str(p))
    assert rc == 2 and len(lines) == 1 and "a JSON list, expected an object" in lines[0], lines


def test_a_layout_training_accepts_still_fits(capsys):
    rc, lines, out = _plan(capsys, "--model-config", str(GPU / "shapes" / "Qwen3-8B"))
    assert rc == 0 and out.rstrip().endswith("fits"), (lines, out)
