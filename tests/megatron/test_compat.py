"""megatron_gspo.megatron.compat against the installed Megatron-Core (0.16.1 in .venv, 0.19.2 in
.venv312): the release is in the supported range, layer-spec submodules read and write on both
spec shapes, the top-k helper gives a training forward's order, the synchronous-save notice is
dropped only inside a synchronous save, every refusal kept names an upstream line that is still
in the installed source, and the tiny demo trains and checkpoints without upstream notices."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.megatron import compat

ROOT = Path(__file__).resolve().parents[2]


def test_installed_release_is_in_the_supported_range():
    import megatron.core

    v = compat.version()
    assert (0, 16, 1) <= v < (0, 20, 0), v
    assert megatron.core.__version__.startswith(".".join(map(str, v)))
    assert compat.SUPPORTED in (ROOT / "pyproject.toml").read_text()


def test_submodules_reads_and_writes_the_moe_expert_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    experts = compat.submodules(compat.submodules(spec.submodules.mlp).experts)
    experts.linear_fc2 = int
    assert compat.submodules(compat.submodules(spec.submodules.mlp).experts).linear_fc2 is int
    with pytest.raises(TypeError, match="has no submodules"):
        compat.submodules(object())


def test_sorted_topk_indices_is_a_training_forwards_order():
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    scores = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    seen = {}

    def spy(scores, topk, num_groups=None, group_topk=None):
        seen["sorted"] = torch.topk(scores, k=topk, dim=1).indices
        return torch.topk(scores, k=topk, dim=1, sorted=torch.is_grad_enabled())

    with torch.no_grad():
        idx = compat.sorted_topk_indices(spy, scores, 4)
    assert torch.equal(idx, seen["sorted"])
    assert not idx.requires_grad
    assert callable(topk_routing_with_score_function)  # the function the docstring names


def _emit_in(code_file: str, func: str, logger: logging.Logger, msg: str) -> None:
    src = f"def {func}(logger, msg):\n    logger.warning(msg)\n"
    ns: dict = {}
    exec(compile(src, code_file, "exec"), ns)  # noqa: S102 - a frame with that file name
    ns[func](logger, msg)


def test_sync_save_notice_is_dropped_only_inside_a_synchronous_save(caplog):
    compat.quiet_logs()
    name = "megatron.core.dist_checkpointing.strategies.torch"
    logger = logging.getLogger(name)
    notice = "MCore's async save is deprecated and will be removed in the future releases."
    strategy = "/x/megatron/core/dist_checkpointing/strategies/torch.py"
    with caplog.at_level(logging.WARNING, logger=name):
        _emit_in(strategy, "save", logger, notice)  # TorchDistSaveShardedStrategy.save
        assert notice not in caplog.text
        _emit_in(strategy, "async_save", logger, notice)  # a real async save on "mcore"
        assert notice in caplog.text
        caplog.clear()
        _emit_in(strategy, "save", logger, "another warning")
        assert "another warning" in caplog.text


def test_async_save_kwargs_name_a_strategy_this_release_has():
    kw = compat.async_save_kwargs()
    if compat.version() < (0, 17, 0):
        assert kw == {}
    else:
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

        assert kw["async_strategy"] in ("nvrx", "mcore")
        assert get_async_strategy(kw["async_strategy"])[0] == kw["async_strategy"]


@pytest.mark.parametrize("name", sorted(compat.REFUSALS))
def test_a_refusal_kept_names_a_line_still_in_the_installed_source(name):
    """A refusal the installed release still needs cites its upstream line: when a release
    drops that line, this fails until the refusal is re-measured and `fixed_in` is set."""
    import megatron.core

    r = compat.REFUSALS[name]
    reason = compat.refusal(name)
    if reason is None:
        pytest.skip(f"{name}: lifted on this release (fixed in {r.fixed_in})")
    src = Path(megatron.core.__file__).parent / r.upstream_file
    text = " ".join(src.read_text().split())
    assert r.upstream_line in text, f"{src} no longer has {r.upstream_line!r}: re-measure {name}"
    assert ".".join(map(str, compat.version())) in reason and "\n" not in reason


def test_layout_refusals_are_one_line_and_name_the_release():
    from megatron_gspo.megatron.models import deepseek_v3
    from megatron_gspo.megatron.parallel import ParallelLayout, ParallelLayoutError, check_layout
    from tests.convert.tiny_families import DEEPSEEK_V3, GPT_OSS

    with pytest.raises(ValueError) as e:
        deepseek_v3.check_training_layout(dict(DEEPSEEK_V3), 2)
    assert "shared rope key" in str(e.value) and "\n" not in str(e.value)
    assert "sequence_parallel=true" in str(e.value)
    deepseek_v3.check_training_layout(dict(DEEPSEEK_V3), 2, sequence_parallel=True)  # trains
    with pytest.raises(ParallelLayoutError) as e:
        check_layout(ParallelLayout(tensor=2, sequence_parallel=True, expert=2), 4,
                     dict(GPT_OSS))
    assert "ETP==1" in str(e.value) and "expert_tensor=1" in str(e.value)
    assert ".".join(map(str, compat.version())) in str(e.value)


@pytest.mark.slow
def test_tiny_demo_trains_and_checkpoints_without_upstream_notices(tmp_path):
    """Three steps of the shipped demo, a checkpoint at step 2 and at the end, then a resumed
    run: no deprecation notice of Megatron-Core reaches the output."""
    run = tmp_path / "run"
    base = [sys.executable, "-m", "megatron_gspo.cli", "train", "examples/tiny/config.yaml",
            "--run-dir", str(run), "train.eval_interval=0", "checkpoint.interval=2",
            "logging.progress_bar=false", "logging.tensorboard=false", "logging.log_samples=0"]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    outs = []
    for steps in (3, 4):
        out = subprocess.run([*base, f"train.max_steps={steps}"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        outs.append(out.stdout + out.stderr)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert (run / "checkpoints" / "step_00000003").is_dir()
    text = "\n".join(outs)
    assert "resum" in outs[1].lower()
    for notice in ("async save is deprecated", "GPTModel IS DEPRECATED", "is experimental",
                   "full scope is deprecated"):
        assert notice not in text, notice
