"""Settings that used to fail late (after the learner was built) or with a traceback are
checked first and end `megatron-gspo train` with one line and exit code 2: the parallel
layout, a missing chat template, agent-mode settings (chat template, environment,
env_kwargs), a label-based reward without labels, a run dir that cannot be written."""

import json
import os
import shutil
from pathlib import Path

import pytest

from megatron_gspo.loop import build
from megatron_gspo.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"


@pytest.fixture
def no_learner(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the learner was built before the input checks failed")

    monkeypatch.setattr(build, "learner", refuse)


def _train(capsys, run_dir, model, *overrides):
    rc = main(["train", str(CONFIG), "--run-dir", str(run_dir), f"model.path={model}",
               "logging.progress_bar=false", "logging.tensorboard=false", *overrides])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return rc, lines, err


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.tensor=3"], "config error: parallel: invalid parallel layout: world size 1"),
    (["agent.enabled=true"], "config error: data.apply_chat_template: must be false"),
    (["agent.enabled=true", "data.apply_chat_template=false", "agent.env_kwargs={bogus: 1}"],
     "config error: agent.env_kwargs: calculator does not take ['bogus']"),
    (["agent.enabled=true", "data.apply_chat_template=false", "agent.environment=nope"],
     "config error: agent.environment: unknown environment 'nope'"),
    (["data.label_key=null"], "config error: reward.name: 'math' compares responses with a "
                              "label but data.label_key is null"),
])
def test_settings_fail_before_the_learner(capsys, tmp_path, random_tiny_model, no_learner,
                                          overrides, needle):
    rc, lines, err = _train(capsys, tmp_path / "run", random_tiny_model, *overrides)
    assert rc == 2 and len(lines) == 1 and needle in lines[0], err[-2000:]


def test_tokenizer_without_chat_template(capsys, tmp_path, random_tiny_model, no_learner):
    model = tmp_path / "model"
    shutil.copytree(random_tiny_model, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((model / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tc))
    rc, lines, err = _train(capsys, tmp_path / "run", model)
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert "config error: data.apply_chat_template: the tokenizer of" in lines[0]


def _unwritable_dirs(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = [blocker / "run"]  # a parent that is a file
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if not os.access(ro, os.W_OK):  # root writes anyway
        out.append(ro / "run")
    if Path("/sys/kernel").is_dir():
        try:
            (Path("/sys") / "megatron_gspo_probe").mkdir()
        except OSError:
            out.append(Path("/sys/megatron_gspo_probe/run"))  # a read-only file system
    return out


def test_run_dir_that_cannot_be_written(capsys, tmp_path, random_tiny_model, no_learner):
    for run_dir in _unwritable_dirs(tmp_path):
        rc, lines, err = _train(capsys, run_dir, random_tiny_model)
        assert rc == 2 and len(lines) == 1, (run_dir, err[-2000:])
        assert f"config error: run dir {run_dir} is not writable" in lines[0]
    (tmp_path / "ro").chmod(0o755)


def test_unsupported_architecture_is_one_line(capsys, tmp_path, random_tiny_model, no_learner):
    model = tmp_path / "model"
    shutil.copytree(random_tiny_model, model)
    hc = json.loads((model / "config.json").read_text())
    # (Mixtral: no adapter, see docs/model-families.md)
    hc.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
              num_local_experts=8, num_experts_per_tok=2)
    (model / "config.json").write_text(json.dumps(hc))
    rc, lines, err = _train(capsys, tmp_path / "run", model)
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert f"config error: model.path: {model}: config.json architectures=" \
           "['MixtralForCausalLM'] is not supported" in lines[0]


def test_released_qwen3_5_checkpoint_is_one_line(capsys, tmp_path, random_tiny_model, no_learner):
    """A released Qwen3.5 (vision-language) checkpoint: one line naming the text-checkpoint
    command (convert/qwen3_5.py)."""
    model = tmp_path / "model"
    shutil.copytree(random_tiny_model, model)
    hc = json.loads((model / "config.json").read_text())
    vl = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
          "text_config": {**hc, "model_type": "qwen3_5_moe_text"}, "vision_config": {}}
    (model / "config.json").write_text(json.dumps(vl))
    rc, lines, err = _train(capsys, tmp_path / "run", model)
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert "vision-language checkpoint" in lines[0], lines[0]
    assert "python -m megatron_gspo.convert.qwen3_5 SRC DST" in lines[0], lines[0]


def test_a_supported_family_with_a_missing_field_is_one_line(capsys, tmp_path,
                                                              random_tiny_model, no_learner):
    model = tmp_path / "model"
    shutil.copytree(random_tiny_model, model)
    hc = json.loads((model / "config.json").read_text())
    hc.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
              num_experts=8, linear_num_value_heads=4, linear_key_head_dim=8)
    (model / "config.json").write_text(json.dumps(hc))
    rc, lines, err = _train(capsys, tmp_path / "run", model)
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "linear_value_head_dim" in lines[0] or "linear_num_key_heads" in lines[0], lines[0]
