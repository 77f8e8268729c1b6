"""LoRA through the CLI: a killed and resumed LoRA run reproduces the uninterrupted run, its
checkpoints hold the adapters (and their optimizer state) only, `convert lora-to-peft` writes
a PEFT adapter that `peft` loads onto the Hugging Face base with the merged model's logits,
and `convert mcore-to-hf` refuses the adapter-only checkpoint in one line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny" / "lora.yaml"
BASE = ROOT / "examples" / "tiny" / "base"  # pretrained: its groups' rewards vary, B moves
FAST = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "algorithm.mini_batches=2", "logging.progress_bar=false", "logging.tensorboard=false",
        "train.eval_interval=0", "logging.log_samples=0", "precision.audit_fraction=0.5",
        "train.max_steps=4", "checkpoint.interval=2"]
TIMING = ("time", "time/", "tokens_per_s", "time_fwd_bwd", "time_optimizer")

pytestmark = pytest.mark.slow


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")


def _cmd(model, run_dir, *extra):
    return [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), "--run-dir",
            str(run_dir), f"model.path={model}", *FAST, *extra]


def _metrics(run_dir):
    rows = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows}


def _convert(*args):
    return subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "convert", *args],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def test_lora_run_resumes_bit_identically_and_exports_to_peft(tmp_path):
    model = BASE
    full = tmp_path / "full"
    out = subprocess.run(_cmd(model, full), cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    ref = _metrics(full)
    assert sorted(ref) == [0, 1, 2, 3]
    assert any(r["grad_norm"] > 0 for r in ref.values())  # the adapters do train

    part = tmp_path / "part"
    proc = subprocess.Popen(_cmd(model, part), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = part / "checkpoints" / "step_00000002" / "COMPLETE"
    deadline = time.time() + 900
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    out = subprocess.run(_cmd(model, part, "train.resume=auto"), cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = _metrics(part)
    for step in (2, 3):
        assert got[step] == ref[step], step

    # adapters only: no base tensor in the checkpoint, the base named in lora.json
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = full / "checkpoints" / "step_00000004"
    keys = set(FileSystemReader(str(ckpt / "model")).read_metadata().state_dict_metadata)
    assert keys and all("lora_" in k for k in keys), sorted(keys)[:5]
    info = json.loads((ckpt / "model" / "lora.json").read_text())
    assert info["base"] == str(model) and info["rank"] == 8

    refused = _convert("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "x"))
    assert refused.returncode == 1 and "lora-to-peft" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1

    peft_dir, merged_dir = tmp_path / "peft", tmp_path / "merged"
    done = _convert("lora-to-peft", "--ckpt", str(ckpt), "--out", str(peft_dir), "--merged",
                    str(merged_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    _check_peft(model, peft_dir, merged_dir)


def _check_peft(base, peft_dir, merged_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    assert conf["r"] == 8 and set(conf["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    ids = torch.tensor([[5, 9, 12, 7, 3, 11, 8, 6]])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        base_logits = plain(ids).logits
        model = PeftModel.from_pretrained(plain, str(peft_dir)).eval()
        peft_logits = model(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        merged_logits = merged(ids).logits
    assert (peft_logits - merged_logits).abs().max().item() <= 1e-5
    assert (peft_logits - base_logits).abs().max().item() > 1e-4  # the adapters did train
