"""LoRA on the Megatron learner (`megatron_gspo/megatron/lora/adapters.py`): the single-process
checks
(float64 layer reference, base identity at B = 0, merged-model equivalence and chain-rule
gradients, GSPO / GSPO-token steps that move only the adapters, partial weight sync, KL to the
adapters-off base, adapter-only checkpoints with bit-identical resume, the PEFT export loaded
by `peft`) and, in the slow tier, TP2 / TP2+SP / PP2 / DP2 / EP2 against them. The cases live
in `_lora_worker.py` (the single-process one: about 10 s of CPU time, 13-24 s wall on
2 busy cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron import _dist


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def single(workdir):
    mp = pytest.MonkeyPatch()
    mp.setattr(_dist, "WORKERS", Path(__file__).with_name("_lora_worker.py"))
    try:
        yield _dist.launch("lora1", 1, workdir, timeout=400)[0]
    finally:
        mp.undo()


def test_lora_single_process(single):
    assert single["failures"] == []
    info = single["info"]
    assert info["dense.adapters_moved"] == 4 * 4 * 2  # 4 layers x 4 targets x (A, B)
    assert info["moe.adapters_moved"] > 4 * 2 * 2  # attention + expert adapters
    assert info["sync.sent"] == 16  # q, k, v, down_proj of 4 layers
    assert info["peft.max_abs_logprob_diff"] <= 1e-5
    assert info["kl_loss"] > 0
    for model in ("dense", "moe"):  # the plan's state bytes (= the learner's) vs full FT
        lora_state, full_state = info[f"{model}.plan_state_bytes"]
        assert 0 < lora_state < full_state / 4


@pytest.mark.slow
def test_lora_parallel_layouts_match_single_process(single, workdir):
    mp = pytest.MonkeyPatch()
    mp.setattr(_dist, "WORKERS", Path(__file__).with_name("_lora_worker.py"))
    try:
        reps = _dist.launch("lora2", 2, workdir, timeout=600)
    finally:
        mp.undo()
    for rank, rep in enumerate(reps):
        assert rep["failures"] == [], f"rank {rank}"
    assert {"dense.tp2", "dense.tp2sp", "dense.pp2", "dense.dp2", "dense.dp2-distopt", "moe.ep2",
            "moe.tp2sp-ep2"} <= set(reps[0]["info"])


def test_lora_refuses_te_grouped_gemm_experts_with_its_reason():
    """The TE spec's grouped-GEMM experts (Megatron-Core 0.16.1 transformer/moe/experts.py:
    TEGroupedMLP holds `linear_fc1` / `linear_fc2`, TEGroupedLinear modules with one `weight<j>`
    per local expert, directly under `mlp.experts`) get the promised one-line refusal, not
    "matches no layer". A stand-in module tree with upstream's names (TE needs CUDA)."""
    import torch

    from megatron_gspo.megatron.lora.adapters import LoraError, LoraSettings, attach, target_of

    class GroupedLinear(torch.nn.Module):  # TEGroupedLinear: weight0..weight{E-1}, no .weight
        def __init__(self):
            super().__init__()
            self.weight0 = torch.nn.Parameter(torch.zeros(4, 4))
            self.weight1 = torch.nn.Parameter(torch.zeros(4, 4))

    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = torch.nn.Module()
    layer.mlp.experts.linear_fc1, layer.mlp.experts.linear_fc2 = GroupedLinear(), GroupedLinear()
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleList([layer])
    assert target_of("decoder.layers.0.mlp.experts.linear_fc1") is not None
    assert target_of("decoder.layers.0.mlp.experts.linear_fc2") is not None
    assert target_of("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1") == "experts.fc1"
    with pytest.raises(LoraError) as e:
        attach([chunk], LoraSettings(rank=2, targets=("experts",)))
    msg = str(e.value)
    assert "Transformer Engine" in msg and "transformer_impl=local" in msg and "\n" not in msg
    assert all(p.requires_grad for p in chunk.parameters())  # refused before anything changed
    # without the experts target the grouped layers are simply not adapted (no refusal)
    assert target_of("decoder.layers.0.mlp.linear_fc1") == "fc1"
