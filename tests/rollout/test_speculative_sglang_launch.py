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


#: How each release's real CPU server ends when launched to draft (measured on this project's
#: x86-64 machines without AMX, scripts/sglang_cpu.sh installs): the KV pool of a speculative
#: server warms up a KV-copy kernel (mem_cache/memory_pool.py `_init_kv_copy_and_warmup`,
#: enabled by `speculative_algorithm is not None`): at 0.5.12 a Triton kernel, which finds no
#: GPU driver; at 0.5.23 sgl_kernel's `copy_all_layer_kv_cache_cpu`, which the CUDA build of
#: sglang-kernel the CPU install uses does not have.
CPU_REFUSAL = {
    "0.5.12": "RuntimeError: 0 active drivers ([]). There should only be one.",
    "0.5.23": "AttributeError: '_OpNamespace' 'sgl_kernel' object has no attribute "
              "'copy_all_layer_kv_cache_cpu'",
}


@pytest.mark.sglang_real
@pytest.mark.parametrize("release", sorted(INSTALLS))
def test_the_real_cpu_server_cannot_draft(release, tmp_path):
    """The launch the trainer makes (GLM-4.5 with its MTP layer, which the CPU engine serves
    without drafting: tests/rollout/test_sglang_real_families.py) ends at start with the line
    `CPU_REFUSAL` names; when an install can draft, this fails and a real-server draft test
    can replace the stand-in's."""
    import shutil
    import time

    from megatron_gspo.rollout.sglang.launch import (LaunchSpec, ServerProcess, cpu_server_env,
                                                     pick_ports, server_argv)
    from tests.convert.tiny_mtp import make_mtp_checkpoint

    py = INSTALLS[release] / "venv" / "bin" / "python"
    if not py.is_file():
        pytest.skip(f"SGLang {release} CPU venv not installed at {py.parent.parent}")
    model = tmp_path / "glm"
    model.mkdir()
    make_mtp_checkpoint("Glm4MoeForCausalLM", model)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "examples" / "tiny" / "base" / f, model / f)
    spec = LaunchSpec(model_path=str(model), dtype="float32", python=str(py), device="cpu",
                      env=cpu_server_env(str(py)), extra_args=(
                          "--skip-server-warmup", *speculative_server_args(
                              "Glm4MoeForCausalLM", 2, 1, None)))
    log = tmp_path / "server.log"
    proc = ServerProcess(server_argv(spec, 0, pick_ports("127.0.0.1", 0, 1)[0]), "spec",
                         env=spec.env, log_path=str(log))
    try:
        deadline = time.monotonic() + 480
        while proc.alive() and time.monotonic() < deadline and CPU_REFUSAL[release] not in (
                log.read_text(errors="replace")):
            time.sleep(2)
        assert CPU_REFUSAL[release] in log.read_text(errors="replace"), (
            log.read_text(errors="replace")[-3000:])
    finally:
        proc.stop()


def test_the_trainer_launch_gets_the_flags_and_the_link_on_the_distributed_path(tmp_path,
                                                                               tiny_model_dir):
    """`loop.server_setup.sglang_engine` (nothing launched until the engine starts): a
    DeepSeek-V3 with its MTP layer gets the speculative flags, plus the link loader on the
    distributed path; a Qwen3 model is refused in one line; so is a flag of one's own."""
    from megatron_gspo.config import ConfigError, load_config
    from megatron_gspo.loop.server_setup import sglang_engine
    from megatron_gspo.rollout.engine import SamplingParams
    from tests.convert.tiny_mtp import make_mtp_checkpoint

    ds = tmp_path / "ds"
    ds.mkdir()
    make_mtp_checkpoint("DeepseekV3ForCausalLM", ds)

    def engine(model, *more):
        cfg = load_config(None, ["rollout.engine=sglang", f"model.path={model}",
                                 "rollout.speculative.algorithm=mtp", *more])
        return sglang_engine(cfg, SamplingParams())

    for sync, link in (("distributed", True), ("tensor", False)):
        eng = engine(ds, f"rollout.weight_sync={sync}", "rollout.colocate=" + str(
            sync == "tensor").lower(), "rollout.speculative.num_steps=3")
        try:
            extra = list(eng.spec.extra_args)
            i = extra.index("--speculative-algorithm")
            assert extra[i:i + 8] == speculative_server_args("DeepseekV3ForCausalLM", 3, 1, None)
            assert (LINK in extra) == link, extra
        finally:
            eng.shutdown()
    with pytest.raises(ConfigError, match="no NEXTN draft model for Qwen3ForCausalLM"):
        engine(tiny_model_dir)
    with pytest.raises(ConfigError, match="--speculative-num-steps together with"):
        engine(ds, "rollout.extra_server_args=[--speculative-num-steps=4]")


def test_plan_names_the_draft_and_refuses_what_the_launch_refuses(tmp_path, tiny_model_dir):
    from megatron_gspo.cli.plan_checks import launch_problems, rollout_line
    from megatron_gspo.config import load_config

    ds = _config(tmp_path, "DeepseekV3ForCausalLM")
    cfg = load_config(None, ["rollout.engine=sglang", f"model.path={ds}",
                             "rollout.speculative.algorithm=mtp"])
    line = rollout_line(cfg)
    assert " speculative=mtp num_steps=2 topk=1 draft_weights_mib=" in line, line
    assert "draft_kv_bytes_per_token=40" in line  # bf16 MLA latent + rope key: (16 + 4) x 2
    assert launch_problems(cfg, 1, 8) == []
    qwen = load_config(None, ["rollout.engine=sglang", f"model.path={tiny_model_dir}",
                              "rollout.speculative.algorithm=mtp"])
    (problem,) = launch_problems(qwen, 1, 8)
    assert "no NEXTN draft model for Qwen3ForCausalLM" in problem
