"""Refusals that used to print tracebacks are one line (issue 53, defect 9): DeepSeek-V3 under
tensor parallelism without sequence parallelism (MoE, and MLA's shared rope key) is refused by
the early checks under a real torchrun of 2 CPU ranks, before torch.distributed or any model
exists, and a broadcast weight sync to `sglang_device=cuda`
servers on a torch without NCCL (this CPU wheel) is a config error naming the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.convert.tiny_families import make_family_model

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "tiny" / "base"
FAST = ["train.max_steps=1", "train.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=2", "logging.progress_bar=false", "logging.tensorboard=false",
        "train.eval_interval=0", "logging.log_samples=0", "checkpoint.interval=0"]


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **extra)


@pytest.mark.slow
def test_deepseek_tensor_parallel_without_sp_is_refused_in_one_line_under_torchrun(tmp_path):
    model = tmp_path / "dsv3"
    make_family_model("DeepseekV3ForCausalLM", model)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (model / f).write_bytes((TOKENIZER / f).read_bytes())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
           "-m", "megatron_gspo.cli", "train", str(ROOT / "examples/tiny/config.yaml"),
           "--run-dir", str(tmp_path / "run"), f"model.path={model}", "parallel.tensor=2",
           "parallel.sequence_parallel=false", *FAST]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    lines = [ln for ln in text.splitlines() if ln.startswith("megatron-gspo: config error:")]
    assert len(lines) == 2, text[-3000:]  # one line from each rank, the same one
    assert len(set(lines)) == 1 and "parallel: invalid parallel layout" in lines[0]
    assert "needs parallel.sequence_parallel=true" in lines[0]
    # the workers print no traceback; what is left is torchrun's own (its ChildFailedError)
    assert text.count("Traceback") <= 1, text[-3000:]
    assert "DeepseekConfigError" not in text


@pytest.mark.skipif(dist.is_nccl_available(), reason="needs a torch without NCCL")
def test_broadcast_sync_without_nccl_names_sglang_device(tmp_path):
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train",
           str(ROOT / "examples/tiny/config.yaml"), "--run-dir", str(tmp_path / "run"),
           "rollout.engine=sglang", "rollout.colocate=false", *FAST]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(
        SGLANG_SERVER_MODULE="megatron_gspo.rollout.standin.server"), capture_output=True,
                         text=True, timeout=600)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and len(err) == 1, out.stderr[-3000:]
    assert err[0].startswith("megatron-gspo: config error: rollout.sglang_device: 'cuda'")
    assert "has no NCCL; set rollout.sglang_device=cpu" in err[0]
    assert not (tmp_path / "run" / "sglang").exists()  # refused before any server started
