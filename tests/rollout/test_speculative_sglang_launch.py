"""Launch of SGLang servers that draft with the model's MTP head (`rollout.speculative.algorithm:
mtp`, `rollout/sglang/speculative.py`): the flags, the one-line refusals, and, in the
`sglang_real` tier, each supported release's own `prepare_server_args` reading the exact command
line the launcher builds (CPU engine flags, speculative flags, the draft link loader of the
distributed path) in its CPU venv (scripts/sglang_cpu.sh; about 25 s per release and family:
SGLang's import); skipped where a venv is not installed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megatron_gspo.rollout.sglang.speculative import (
    LINK,
    draft_bytes,
    link_launch_extras,
    speculative_server_args,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_sglang_spec_launch_worker.py")
INSTALLS = {"0.5.12": ROOT / ".sglang-cpu", "0.5.23": ROOT / ".sglang-cpu-0.5.23"}


def test_flags_and_refusals():
    assert speculative_server_args("DeepseekV3ForCausalLM", 2, 1, None) == [
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]
    assert speculative_server_args("Glm4MoeForCausalLM", 3, 2, 6)[-1] == "6"
    cases = [
        (("DeepseekV3ForCausalLM", 2, 1, None, ["--speculative-algorithm=EAGLE"]),
         "rollout.extra_server_args: --speculative-algorithm together with rollout.speculative"),
        (("Qwen3ForCausalLM", 2, 1, None, []), "no NEXTN draft model for Qwen3ForCausalLM"),
        (("LlamaForCausalLM", 2, 1, None, []), "no NEXTN draft model for LlamaForCausalLM"),
        (("Qwen3NextForCausalLM", 2, 1, None, []),
         "Qwen3NextForCausalLMMTP, but the learner builds no MTP layer"),
        (("DeepseekV3ForCausalLM", 2, 1, 5, []), "num_draft_tokens: 5 with topk 1"),
        (("DeepseekV3ForCausalLM", 2, 2, 7, []), "num_draft_tokens: 7 outside (2, 5]"),
    ]
    for (arch, steps, topk, tokens, extra), want in cases:
        with pytest.raises(ValueError) as e:
            speculative_server_args(arch, steps, topk, tokens, extra)
        assert want in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_link_loader_joins_the_delta_loader_flag(tmp_path):
    extra, env = link_launch_extras(("--skip-server-warmup",), {}, str(tmp_path / "l"))
    assert extra == ("--skip-server-warmup", "--custom-weight-loader", LINK)
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path / "l")
    assert (tmp_path / "l" / "gspo_delta_loader.py").is_file()
    both, env2 = link_launch_extras(("--custom-weight-loader", "gspo_delta_loader.load", "--x"),
                                    {"PYTHONPATH": "/d"})
    assert both == ("--custom-weight-loader", "gspo_delta_loader.load", LINK, "--x")
    assert env2 == {"PYTHONPATH": "/d"}  # the delta loader's folder holds the same file


def test_draft_memory_of_a_deepseek_v3_mtp_layer():
    from tests.convert.tiny_families import DEEPSEEK_V3

    cfg = dict(DEEPSEEK_V3, num_nextn_predict_layers=1)
    weights, kv = draft_bytes(cfg, 2, 1000)
    assert kv == (16 + 4) * 1000 * 2  # MLA: kv_lora_rank + qk_rope_head_dim per token
    h = 64
    assert weights > (2 * h * h + 9 * 3 * h * 16) * 2  # eh_proj and 8 + 1 experts at least


def _config(tmp_path: Path, arch: str) -> Path:
    from tests.convert.tiny_families import FAMILIES

    cls, fields = FAMILIES[arch]
    d = cls(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")}
            ).to_dict()
    d.update(architectures=[arch], num_nextn_predict_layers=1)
    out = tmp_path / arch
    out.mkdir()
    (out / "config.json").write_text(json.dumps(d))
    return out


@pytest.mark.sglang_real
@pytest.mark.parametrize("release", sorted(INSTALLS))
@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"])
def test_each_release_reads_our_speculative_command_line(release, arch, tmp_path):
    from megatron_gspo.rollout.sglang.launch import LaunchSpec, cpu_server_env, server_argv

    py = INSTALLS[release] / "venv" / "bin" / "python"
    if not py.is_file():
        pytest.skip(f"SGLang {release} CPU venv not installed at {py.parent.parent} "
                    f"(scripts/sglang_cpu.sh {release})")
    model = _config(tmp_path, arch)
    extra, env = link_launch_extras(tuple(speculative_server_args(arch, 3, 1, None)), {},
                                    str(tmp_path / "loader"))
    spec = LaunchSpec(model_path=str(model), device="cpu", dtype="float32", extra_args=extra,
                      python=str(py), env=env)
    argv = server_argv(spec, 0, 30000, 22001)
    run_env = {"PATH": "/usr/bin:/bin", **cpu_server_env(str(py), {}), **env}
    r = subprocess.run([str(py), str(WORKER), json.dumps(argv[3:])], env=run_env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith(("RESULT ", "ERROR ")))
    assert line.startswith("RESULT "), line
    got = json.loads(line[7:])
    assert got == {"version": release, "algorithm": "EAGLE", "draft_model_path": str(model),
                   "num_steps": 3, "topk": 1, "num_draft_tokens": 4,
                   "disable_overlap_schedule": True, "max_running_requests": 48,
                   "device": "cpu", "attention_backend": "torch_native",
                   "custom_weight_loader": [LINK]}, got
