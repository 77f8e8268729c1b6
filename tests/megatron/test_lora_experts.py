"""LoRA on MoE experts (`megatron_gspo/megatron/lora/adapters.py`, `lora/io.py`; issue 55
item 5): routed and shared experts' adapters against a merged-weight model (log-probs and
chain-rule gradients), the merged partial sync of expert weights (only the experts whose
adapters changed: `export_hf_weights(only_changed=True)`), the PEFT export of routed
experts that `peft` loads (transformers 5's fused expert tensors through `target_parameters`),
the refusals with peft's reason, and (slow) EP2 / TP2+SP+EP2 against one process. The cases live
in `_lora_experts_worker.py` (one process: about 8 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron import _dist


def _launch(case: str, n: int, workdir: Path):
    mp = pytest.MonkeyPatch()
    mp.setattr(_dist, "WORKERS", Path(__file__).with_name("_lora_experts_worker.py"))
    try:
        return _dist.launch(case, n, workdir, timeout=400)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("lorax")


@pytest.fixture(scope="module")
def single(workdir):
    return _launch("lorax1", 1, workdir)[0]


def test_lora_on_routed_and_shared_experts_single_process(single):
    assert single["failures"] == []
    info = single["info"]
    assert {"experts.fc1", "experts.fc2", "shared_experts.fc1",
            "shared_experts.fc2"} <= set(info["glm.kinds"])
    assert info["glm.shared_adapter_grads"] == 3 * 2 * 2  # 3 MoE layers x (fc1, fc2) x (A, B)
    assert info["glm.logprob_vs_merged"] <= 1e-5 and info["glm.grad_vs_chain_rule"] <= 1e-5
    # partial sync: q, k, v, o + 4 experts x (gate, up, down) in 4 layers
    assert info["moe.sync.sent"] == 4 * (4 + 4 * 3)
    assert info["moe.sync.engine_vs_learner"] <= 1e-5
    # only_changed: expert 2's fc1 and layer 0's qkv adapters changed -> exactly their tensors
    assert info["moe.changed_sync.sent"] == sorted(
        [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
        + [f"model.layers.1.mlp.experts.2.{p}.weight" for p in ("gate_proj", "up_proj")])
    assert info["moe.changed_sync.engine_vs_learner"] <= 1e-5
    # the loop's sync_weights into a stand-in SGLang server: full, partial, one expert; the
    # probe passes each time and the served weights equal the learner's merged ones (worker)
    assert all(info[f"moe.probe.v{v}"] is not None and info[f"moe.probe.v{v}"] <= 1e-3
               for v in (1, 2, 3))
    assert info["moe.peft.max_abs_logprob_diff"] <= 1e-5
    assert info["moe.peft.adapters_off_diff"] > 1e-2
    assert info["moe.peft.merge_and_unload_max_diff"] <= 1e-6
    if info["glm.peft_version_rewrites"]:  # peft < 0.22: refused with its reason
        refusal = info["glm.peft_refusal"]
        assert "shared experts" in refusal and "_convert_peft_config_moe" in refusal
        assert "\n" not in refusal
    else:  # shared experts (3 MoE layers x gate, up, down) load with the learner's lps
        assert info["glm.peft.shared_wrapped"] == 3 * 3
        assert info["glm.peft.max_abs_logprob_diff"] <= 1e-5
        assert info["glm.peft.adapters_off_diff"] > 1e-2


@pytest.mark.slow
def test_lora_experts_ep2_and_tp2sp_ep2_match_single_process(single, workdir):
    reps = _launch("lorax2", 2, workdir)
    for rank, rep in enumerate(reps):
        assert rep["failures"] == [], f"rank {rank}"
    info = reps[0]["info"]
    for tag in ("glm.ep2", "glm.tp2sp-ep2"):
        assert info[f"{tag}.grad_max_diff"] <= 1e-5
        assert info[f"{tag}.changed_sync.sent"] == [  # expert 5 lives on EP rank 1
            f"model.layers.2.mlp.experts.5.{p}.weight" for p in ("gate_proj", "up_proj")]


def test_peft_keeps_module_path_mlp_targets_of_an_moe_model(monkeypatch):
    """Checked in peft itself, on a transformers 5 GLM-4.5 (model type mapped to qwen2_moe's
    conversion): peft >= 0.22 keeps the export's module-path targets (`shared_experts.gate_proj`,
    `mlp.gate_proj`) on the `nn.Linear` layers; peft 0.21 rewrote them into the routed experts'
    `gate_up_proj`, which is why the export refuses them under an older peft."""
    import transformers
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    from megatron_gspo.megatron.lora import io as lora_io
    from tests.convert.tiny_families import GLM4_MOE

    cfg = {k: v for k, v in GLM4_MOE.items() if k not in ("architectures", "model_type")}
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**cfg))
    targets = {"shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj",
               "mlp.gate_proj", "q_proj"}
    lc = LoraConfig(r=2, target_modules=sorted(targets))
    convert_peft_config_for_transformers(lc, model=model, conversions=None)
    rewrites = lora_io.peft_rewriting_moe_mlp()
    if rewrites:
        assert set(lc.target_modules) == {"q_proj"}
        assert {"gate_up_proj", "down_proj"} <= set(lc.target_parameters)
        assert "shared experts" in lora_io.peft_refusal(("experts", "shared_experts"), GLM4_MOE)
    else:
        assert set(lc.target_modules) == targets and not lc.target_parameters
        assert lora_io.peft_refusal(("experts", "shared_experts"), GLM4_MOE) is None
    monkeypatch.setattr(lora_io, "peft_rewriting_moe_mlp", lambda: "0.21.2")
    refusal = lora_io.peft_refusal(("experts", "shared_experts"), GLM4_MOE)
    assert "peft 0.21.2" in refusal and ">= 0.22" in refusal and "\n" not in refusal
    assert lora_io.peft_refusal(("qkv", "experts"), GLM4_MOE) is None
    assert "dropout" in lora_io.peft_refusal(("experts",), GLM4_MOE, dropout=0.1)
    gpt_oss = {"architectures": ["GptOssForCausalLM"], "num_local_experts": 4}
    assert "gpt-oss" in lora_io.peft_refusal(("experts",), gpt_oss)
    assert lora_io.peft_refusal(("qkv", "fc1"), {"architectures": ["Qwen3ForCausalLM"]}) is None
