"""A run never resumes into, or over, what is not its own (issue 43 items 3, 4, 5, 12, 19).

- The checkpoint dir is locked like the run dir: a second run with another run dir but the
  same `checkpoint.dir` is refused in one line naming the first run (item 3).
- `resume: auto` in a run dir with metrics but no checkpoint is refused; metrics.jsonl is left
  as it was (item 4).
- What a checkpoint records is compared before any tensor is read (`loop/resume_checks.py`,
  run by `Checkpointer.load`): the model and its initial weights (model.path by fingerprint),
  model.dtype, LoRA or not, rank, targets, alpha, the base; the data cursor names train.seed,
  data.shuffle and the train file; model.load_checkpoint of another model; LoRA experts on a
  dense model; a config.json without "architectures" (items 5, 12, 19).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import ConfigError, config_from_dict
from megatron_gspo.runtime.run_checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "tiny" / "config.yaml")


def _cli(args):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron_gspo.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _one_line(out) -> str:
    err = [ln for ln in out.stderr.splitlines() if ln.startswith("megatron-gspo:")]
    assert out.returncode == 2 and len(err) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return err[0]


def test_a_second_run_on_the_same_checkpoint_dir_is_refused(random_tiny_model, tmp_path):
    ck, first, second = tmp_path / "ck", tmp_path / "first", tmp_path / "second"
    code = ("import time\nfrom megatron_gspo.runtime.rundir import RunDirLock\n"
            f"RunDirLock({str(first)!r}, {str(ck)!r}).acquire()\n"
            "print('held', flush=True)\ntime.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        out = _cli(["train", CONFIG, "--run-dir", str(second), f"model.path={random_tiny_model}",
                    f"checkpoint.dir={ck}", "train.max_steps=1"])
    finally:
        p.kill()
        p.wait()
    err = _one_line(out)
    assert f"checkpoint dir {ck}" in err and str(first) in err and f"pid {p.pid}" in err, err
    assert not (second / "metrics.jsonl").exists() and not (second / "run.lock").exists()


def test_resume_auto_with_metrics_and_no_checkpoint_is_refused(random_tiny_model, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    out = _cli(["train", CONFIG, "--run-dir", str(run), f"model.path={random_tiny_model}",
                f"checkpoint.dir={tmp_path / 'unmounted'}", "train.max_steps=1"])
    err = _one_line(out)
    assert str(run) in err and "no complete checkpoint" in err and "resume" in err, err
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'


@pytest.mark.slow
def test_a_run_that_ended_before_its_first_checkpoint_starts_over(random_tiny_model, tmp_path):
    """Killed before any checkpoint (events.log names none): resume auto redoes its steps from
    the initial weights, as a resume redoes the steps after its checkpoint; once events.log
    names a checkpoint that is gone, the same run dir is refused."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "stale": 1}\n')
    (run / "events.log").write_text("[00:00:00] run dir x; starting from the initial weights\n")
    args = ["train", CONFIG, "--run-dir", str(run), f"model.path={random_tiny_model}",
            f"checkpoint.dir={tmp_path / 'ckpt'}", "train.max_steps=1", "rollout.group_size=2",
            "train.prompts_per_step=2", "train.eval_interval=0", "logging.tensorboard=false"]
    out = _cli(args)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] and "stale" not in rows[0]
    shutil.rmtree(tmp_path / "ckpt")  # the checkpoint the run wrote is gone now
    err = _one_line(_cli(args))
    assert "no complete checkpoint" in err, err


# ----------------------------------------------------------------------------- what is recorded

def _model(d: Path, arch="Qwen3ForCausalLM", seed=0, **kw) -> Path:
    from tests.convert.tiny_models import make_tiny_model

    make_tiny_model(arch, d, seed=seed, **kw)
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"a": _model(root / "a"), "copy_of_a": _model(root / "copy_of_a"),
            "a_finetuned": _model(root / "a_finetuned", seed=1),
            "llama": _model(root / "llama", "LlamaForCausalLM")}


def _checkpoint(tmp_path: Path, source: Path, dtype="bfloat16", lora=None) -> Path:
    """A run checkpoint's model/ records as the learner writes them (no tensors needed)."""
    from megatron_gspo.convert.hf_io import read_config
    from megatron_gspo.convert.sources import write_model_info
    from megatron_gspo.megatron.lora.io import write_adapter_info

    step = tmp_path / "checkpoints" / "step_00000002"
    (step / "model").mkdir(parents=True)
    write_model_info(step / "model", read_config(source), dtype, source)
    if lora is not None:
        write_adapter_info(step / "model", lora, str(source))
    return step


def _cfg(model: Path, *overrides):
    return config_from_dict({"model": {"path": str(model)}}, list(overrides))


LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[qkv,proj]"]
CASES = {
    # name: (checkpoint is LoRA, model.path key, overrides, the field named)
    "other_model_path": (False, "a_finetuned", [], "model.path"),
    "another_architecture": (False, "llama", [], "model.path"),
    "dtype": (False, "a", ["model.dtype=float32"], "model.dtype"),
    "lora_on_full": (False, "a", LORA, "model.lora.rank"),
    "lora_rank_0": (True, "a", [], "model.lora.rank"),
    "lora_rank": (True, "a", [*LORA, "model.lora.rank=8"], "model.lora.rank"),
    "lora_targets": (True, "a", [*LORA, "model.lora.targets=[qkv]"], "model.lora.targets"),
    "lora_alpha": (True, "a", [*LORA, "model.lora.alpha=32"], "model.lora.alpha"),
    "lora_base": (True, "a_finetuned", LORA, "model.path"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_refuses_what_the_checkpoint_does_not_record(models, tmp_path, case):
    from megatron_gspo.convert.hf_io import read_config
    from megatron_gspo.loop.resume_checks import check_resume
    from megatron_gspo.megatron.lora.adapters import LoraSettings

    is_lora, path, overrides, field = CASES[case]
    step = _checkpoint(tmp_path, models["a"], lora=LoraSettings(
        rank=4, alpha=8.0, targets=("qkv", "proj")) if is_lora else None)
    cfg = _cfg(models[path], *overrides)
    with pytest.raises(ConfigError) as e:
        check_resume(cfg, read_config(models[path]), step)
    msg = str(e.value)
    assert msg.startswith(f"{field}:") and len(msg.splitlines()) == 1, msg
    assert str(step) in msg, msg


def test_the_same_model_elsewhere_resumes(models, tmp_path):
    from megatron_gspo.convert.hf_io import read_config
    from megatron_gspo.loop.resume_checks import check_resume

    step = _checkpoint(tmp_path, models["a"])
    check_resume(_cfg(models["copy_of_a"]), read_config(models["copy_of_a"]), step)


def test_the_check_runs_before_the_learner_loads(tmp_path):
    calls = []

    class Learner:
        chunks = [torch.nn.Linear(1, 1)]

        def save_checkpoint(self, path):
            os.makedirs(path, exist_ok=True)

        def load_checkpoint(self, path):
            calls.append("load")

        def resume_check(self, path):
            calls.append("check")
            raise ConfigError("model.path: refused")

    ck = Checkpointer(tmp_path / "ck")
    path = ck.save(1, Learner(), {"step": 1})
    with pytest.raises(ConfigError):
        ck.load(path, Learner())
    assert calls == ["check"]


@pytest.mark.parametrize("change,field", [({"seed": 7}, "train.seed"),
                                          ({"shuffle": False}, "data.shuffle"),
                                          ({"size": 99}, "data.train_path")])
def test_the_data_cursor_names_the_setting(change, field):
    from megatron_gspo.data.datasets import DatasetError, PromptIterator

    it = PromptIterator(list(range(10)), seed=3, shuffle=True)
    state = {**it.state_dict(), **change}
    with pytest.raises(DatasetError, match=rf"^{field}:"):
        PromptIterator(list(range(10)), seed=3, shuffle=True).load_state_dict(state)


@pytest.mark.slow
def test_load_checkpoint_of_another_model_is_one_line(models, tmp_path):
    from megatron_gspo.convert.hf_io import read_config
    from megatron_gspo.loop.resume_checks import check_load_checkpoint

    ck = tmp_path / "llama_mcore"
    p = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tools" /
                        "convert_checkpoint.py"), "hf-to-mcore", "--hf", str(models["llama"]),
                        "--out", str(ck), "--no-progress"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = _cfg(models["a"], f"model.load_checkpoint={ck}")
    with pytest.raises(ConfigError, match=r"^model\.load_checkpoint: .*architectures"):
        check_load_checkpoint(cfg, read_config(models["a"]))
    check_load_checkpoint(_cfg(models["llama"], f"model.load_checkpoint={ck}"),
                          read_config(models["llama"]))


def test_experts_on_a_dense_model_and_missing_architectures(models, tmp_path):
    from megatron_gspo.convert.hf_io import read_config
    from megatron_gspo.loop import build

    cfg = _cfg(models["a"], "model.lora.rank=4", "model.lora.targets=[experts]")
    with pytest.raises(ConfigError, match=r"^model\.lora\.targets: 'experts'.*dense"):
        build.learner(cfg, read_config(models["a"]))  # before anything is built
    d = tmp_path / "noarch"
    shutil.copytree(models["a"], d)
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text.replace('"architectures"', '"_architectures"'))
    with pytest.raises(ConfigError, match=r'add "architectures": \["Qwen3ForCausalLM"\]'):
        build.read_hf_config(str(d))
