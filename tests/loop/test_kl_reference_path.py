"""`model.reference_path`: a reference whose config is not the policy's architecture, or that
has no usable config.json, is a one-line config error naming the field before anything is
built; a reference with other weights is what the KL is measured against (kl/mean > 0 at step 0,
where the sampling policy is the initial policy)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.loop import build, early_checks
from megatron_gspo.config import ConfigError, config_from_dict

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples" / "tiny" / "base"


def _check(ref_path) -> None:
    cfg = config_from_dict({}, [f"model.path={BASE}", "algorithm.kl_coef=0.05",
                                f"model.reference_path={ref_path}"])
    early_checks.check_inputs(cfg, build.read_hf_config(str(BASE)), build.tokenizer(cfg))


def _copy_config(tmp_path: Path, **changes) -> Path:
    d = tmp_path / "ref"
    d.mkdir()
    c = json.loads((BASE / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))
    return d


def test_reference_with_another_architecture_is_a_config_error(tmp_path):
    ref = _copy_config(tmp_path, hidden_size=64)
    with pytest.raises(ConfigError, match=r"^model\.reference_path: .*hidden_size") as e:
        _check(ref)
    assert "\n" not in str(e.value)


def test_reference_of_another_model_family_is_a_config_error(tmp_path):
    ref = _copy_config(tmp_path, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ConfigError, match=r"^model\.reference_path: .*architectures"):
        _check(ref)


def test_reference_without_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.reference_path: .*config\.json"):
        _check(tmp_path / "missing")


def test_reference_with_the_policy_architecture_passes(tmp_path):
    _check(_copy_config(tmp_path))


@pytest.mark.slow
def test_run_measures_kl_to_the_reference_path_weights(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    ref = tmp_path / "ref"
    model = AutoModelForCausalLM.from_pretrained(str(BASE), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(ref))
    for f in BASE.iterdir():  # tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens")) and not (ref / f.name).exists():
            shutil.copy(f, ref / f.name)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(ROOT / "examples" / "tiny" /
                                                                  "config.yaml"),
           "--run-dir", str(run), "train.max_steps=1", "train.prompts_per_step=4",
           "rollout.group_size=4", "rollout.max_new_tokens=6", "train.eval_interval=0",
           "logging.progress_bar=false", "logging.tensorboard=false", "logging.log_samples=0",
           "checkpoint.interval=0", "algorithm.kl_coef=0.05", f"model.reference_path={ref}"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    # with the initial weights as reference this is < 1e-6 at step 0 (test_kl_train)
    assert row["kl/mean"] > 1e-3, row["kl/mean"]
    assert f"KL reference ({ref}, frozen)" in (run / "events.log").read_text()
