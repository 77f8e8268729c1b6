"""A setting the rest of the config makes the run ignore is an error naming the field and the
choice that ignores it (issue 54, defect 12; config/unused.py)."""

import pytest

from megatron_gspo.config import ConfigError, load_config

SGLANG = ["rollout.engine=sglang", "model.path=/m"]


@pytest.mark.parametrize("overrides, field, because", [
    (["rollout.weight_sync_delta_threshold=0.3"], "rollout.weight_sync_delta_threshold",
     "rollout.weight_sync_delta 'off'"),
    ([*SGLANG, "rollout.weight_sync_delta_threshold=0.3", "rollout.weight_sync_delta=on"],
     "rollout.weight_sync_delta_threshold", "rollout.weight_sync_delta 'on'"),
    ([*SGLANG, "rollout.weight_sync_delta_base=hash"], "rollout.weight_sync_delta_base",
     "rollout.weight_sync_delta 'off'"),
    (["rollout.tp_size=2"], "rollout.tp_size", "rollout.engine 'embedded'"),
    (["rollout.num_servers=4"], "rollout.num_servers", "rollout.engine 'embedded'"),
    (["rollout.mem_fraction=0.5"], "rollout.mem_fraction", "rollout.engine 'embedded'"),
    (["rollout.server_urls=[http://a:1]"], "rollout.server_urls", "rollout.engine 'embedded'"),
    (["rollout.sglang_device=cpu"], "rollout.sglang_device", "rollout.engine 'embedded'"),
    (["agent.max_turns=3"], "agent.max_turns", "agent.enabled false"),
    (["agent.env_kwargs={x: 1}"], "agent.env_kwargs", "agent.enabled false"),
    (["agent.python_tool=true"], "agent.python_tool", "agent.enabled false"),
    (["precision.old_logprobs=recompute", "precision.tolerance=0.2"], "precision.tolerance",
     "precision.old_logprobs 'recompute'"),
    (["precision.old_logprobs=rollout", "precision.recheck_interval=2"],
     "precision.recheck_interval", "precision.old_logprobs 'rollout'"),
    (["precision.old_logprobs=recompute", "precision.audit_fraction=0.5"],
     "precision.audit_fraction", "precision.old_logprobs 'recompute'"),
    # accepted until issue 57 (docs/configuration.md listed them as having no effect)
    (["rollout.offload_learner=true"], "rollout.offload_learner", "rollout.engine 'embedded'"),
    ([*SGLANG, "rollout.colocate=false", "rollout.offload_learner=false"],
     "rollout.offload_learner", "rollout.engine 'sglang' and rollout.colocate false"),
    (["rollout.fp8_bf16_layers=1"], "rollout.fp8_bf16_layers",
     "rollout.weight_precision 'bf16'"),
    (["train.eval_samples=4", "train.eval_temperature=1"], "train.eval_samples",
     "train.eval_interval 0"),
    (["logging.wandb_name=run1"], "logging.wandb_name", "logging.wandb_project unset"),
])
def test_an_ignored_setting_is_refused(overrides, field, because):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert msg.startswith(f"{field}: not used with {because}") and "\n" not in msg, msg


@pytest.mark.parametrize("overrides", [
    [*SGLANG, "rollout.weight_sync_delta=auto", "rollout.weight_sync_delta_threshold=0.3",
     "rollout.weight_sync_delta_base=hash"],
    [*SGLANG, "rollout.weight_sync_delta=on", "rollout.weight_sync_delta_base=hash"],
    [*SGLANG, "rollout.tp_size=2", "rollout.num_servers=4", "rollout.mem_fraction=0.5"],
    ["agent.enabled=true", "agent.max_turns=3"],
    ["precision.tolerance=0.2", "precision.recheck_interval=2"],
    ["precision.old_logprobs=rollout", "precision.audit_fraction=0.5"],
    ["precision.old_logprobs=recompute", "precision.mismatch_scale=2"],  # the audit reads it
])
def test_a_setting_the_choice_reads_is_accepted(overrides):
    load_config(None, overrides)
