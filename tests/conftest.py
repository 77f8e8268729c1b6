"""The `mcore_new` tier: the tests that run in the second environment, .venv312 (Python 3.12,
megatron-core 0.19.2, scripts/megatron_py312.sh), chosen here by node id so the test files stay
as they are. `.ci/run` runs them with scripts/mcore_new_tier.sh after the other tiers
(README, "Supported versions"): the learner's layout invariance (TP/PP/EP/CP/SP), conversion
round trips, the model families' parity and learner tests, LoRA, the compat checks,
asynchronous checkpoints beside each nvidia-resiliency-ext release, and a short run of the tiny
demo. With MEGATRON_GSPO_MCORE_NEW_REQUIRED=1 (CI) the tier refuses to run on a Megatron-Core
older than 0.19 (it would test the first environment again).
"""

from __future__ import annotations

import os

import pytest

# node-id prefixes of the tier (a prefix ending in ".py" takes the whole file); what the tier
# leaves out, and why, is in the README's "Supported versions"
MCORE_NEW = (
    "tests/megatron/test_compat.py",
    "tests/megatron/test_async_save_nvrx.py",
    "tests/megatron/test_mg_learner_parallel.py",
    "tests/megatron/test_family_train.py",
    "tests/convert/test_family_parity.py::test_single_process_logits_match_transformers",
    "tests/convert/test_family_parity.py::test_tp2_pp2_ep2_logits_match_transformers",
    "tests/convert/test_layouts.py",
    "tests/megatron/test_lora.py",
    "tests/megatron/test_lora_experts.py",
    "tests/megatron/test_deepseek_v3_config.py",
    "tests/megatron/test_mla_tensor_parallel.py::test_mla_tp2_sp_gradients_match_one_process",
    "tests/megatron/test_gpt_oss_config.py",
    "tests/megatron/test_gemma3_config.py",
    "tests/megatron/test_glm4_moe_config.py",
    "tests/megatron/test_mg_model_config.py",
    "tests/megatron/test_moe_without_te.py",
    "tests/megatron/test_mtp_learner.py",
    "tests/megatron/test_mtp_draft_loss.py::"
    "test_mtp_loss_leaves_the_policy_gradient_and_step_unchanged_tiny_demo",
    "tests/convert/test_mtp_convert.py",
    "tests/convert/test_mtp_cli.py::test_cli_roundtrip_keeps_the_mtp_layer_bit_exact"
    "[write0-read0-DeepseekV3ForCausalLM]",
    "tests/convert/test_mtp_cli.py::test_cli_roundtrip_keeps_the_mtp_layer_bit_exact"
    "[write1-read1-Glm4MoeForCausalLM]",
    "tests/convert/test_dsa_parity.py",
    "tests/megatron/test_dsa_train.py",
    "tests/megatron/test_gdn_kernels.py",
    "tests/convert/test_qwen3_next_parity.py::test_single_process_logits_match_transformers",
    "tests/convert/test_qwen3_next_parity.py::test_tp2_pp2_ep2_logits_match_transformers",
    "tests/convert/test_qwen3_next_parity.py::test_packed_rows_match_transformers_per_sequence",
    "tests/convert/test_qwen3_next_parity.py::test_layouts_round_trip_bit_exact",
    "tests/convert/test_qwen3_next_parity.py::test_unbuilt_layouts_are_refused",
    "tests/megatron/test_qwen3_next_train.py",
    "tests/convert/test_qwen3_5_parity.py::test_single_process_logits_match_transformers",
    "tests/convert/test_qwen3_5_parity.py::test_tp2_pp2_ep2_logits_match_transformers",
    "tests/convert/test_qwen3_5_parity.py::test_packed_rows_match_transformers_per_sequence",
    "tests/convert/test_qwen3_5_parity.py::test_layouts_round_trip_bit_exact",
    "tests/megatron/test_qwen3_5_train.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.nodeid == p or item.nodeid.startswith(p if p.endswith(".py") else p + "[")
               or item.nodeid.startswith(p + "::") for p in MCORE_NEW):
            item.add_marker(pytest.mark.mcore_new)


def pytest_sessionstart(session):
    if os.environ.get("MEGATRON_GSPO_MCORE_NEW_REQUIRED") != "1":
        return
    from megatron_gspo.megatron.compat import version

    if version() < (0, 19, 0):
        raise pytest.UsageError(
            f"the mcore_new tier needs megatron-core 0.19 (.venv312), found "
            f"{'.'.join(map(str, version()))}: run it with .venv312/bin/python")
