"""An FP8 server's launch at both supported SGLang releases (0.5.12, 0.5.23): the command line
our launcher builds for the FP8 copy (`rollout.weight_precision: fp8`), with the environment
`loop/fp8_rollout.server_env` gives Blackwell servers, read by each release's own
`prepare_server_args` and `ModelConfig` in its CPU venv (scripts/sglang_cpu.sh): no
`--quantization` flag is needed (the model config takes "fp8" from the checkpoint's
`quantization_config`), the KV cache stays in the model dtype, the FP8 GEMM and MoE runners are
SGLang's defaults, and SGLANG_ENABLE_JIT_DEEPGEMM=0 turns DeepGEMM off (no UE8M0 requant of
the scales at load). Why each: docs/weight-sync.md "FP8 servers". Tier `sglang_real` (about
25 s per release: SGLang's import); skipped where a venv is not installed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang_real

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_sglang_fp8_launch_worker.py")
INSTALLS = {"0.5.12": ROOT / ".sglang-cpu", "0.5.23": ROOT / ".sglang-cpu-0.5.23"}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_gspo.quant.fp8_checkpoint import write_fp8_checkpoint

    d = tmp_path_factory.mktemp("fp8_launch")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=2048, tie_word_embeddings=False)).to(
            torch.bfloat16).save_pretrained(d / "bf16")
    write_fp8_checkpoint(d / "bf16", d / "fp8")
    return d / "fp8"


@pytest.mark.parametrize("release", sorted(INSTALLS))
def test_fp8_server_command_line_at_each_release(release, fp8_dir):
    from megatron_gspo.loop.fp8_rollout import server_env
    from megatron_gspo.rollout.sglang.launch import (LaunchSpec, cpu_server_env, server_argv,
                                                     server_env as launch_env)

    py = INSTALLS[release] / "venv" / "bin" / "python"
    if not py.is_file():
        pytest.skip(f"SGLang {release} CPU venv not installed at {py.parent.parent} "
                    f"(scripts/sglang_cpu.sh {release})")
    spec = LaunchSpec(model_path=str(fp8_dir), colocated=True, mem_fraction_static=0.5,
                      env=server_env((10, 0)))  # a Blackwell server's launch
    argv = server_argv(spec, 0, 30000, 22001)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert not {"--quantization", "--kv-cache-dtype", "--fp8-gemm-backend",
                "--moe-runner-backend"} & set(argv)
    env = {"PATH": "/usr/bin:/bin", **cpu_server_env(str(py), {}), **launch_env(spec)}
    assert env["SGLANG_ENABLE_JIT_DEEPGEMM"] == "0"
    r = subprocess.run([str(py), str(WORKER), json.dumps(argv[3:])], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert got == {"version": release, "quantization_flag": None, "model_quantization": "fp8",
                   "kv_cache_dtype": "auto", "fp8_gemm_backend": "auto",
                   "moe_runner_backend": "auto", "model_dtype": "torch.bfloat16",
                   "deepgemm_enabled": False}, got
