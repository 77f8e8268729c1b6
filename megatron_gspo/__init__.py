"""megatron-gspo: Group Sequence Policy Optimization (arXiv 2507.18071) with a Megatron-Core
learner and SGLang rollouts.

Modules that moved keep their old dotted paths as an error naming the new one, through one table
(`MOVED`): `import megatron_gspo.loop.sync` raises
`ImportError: megatron_gspo.loop.sync moved to megatron_gspo.loop.weight_sync_phase: import that
instead`. docs/layout.md lists where each concept lives.
"""

import importlib.abc
import sys

__version__ = "0.1.0"

# Old module path -> new module path (every move of the package's modules, one table).
MOVED = {
    "megatron_gspo.megatron.model": "megatron_gspo.megatron.models.builder",
    "megatron_gspo.megatron.local_layers": "megatron_gspo.megatron.models.local_layers",
    "megatron_gspo.megatron.te_conditions": "megatron_gspo.megatron.models.te_conditions",
    "megatron_gspo.megatron.padding_idx": "megatron_gspo.megatron.models.padding_idx",
    "megatron_gspo.megatron.gemma3": "megatron_gspo.megatron.models.gemma3",
    "megatron_gspo.megatron.gemma_layers": "megatron_gspo.megatron.models.gemma_layers",
    "megatron_gspo.megatron.deepseek_v3": "megatron_gspo.megatron.models.deepseek_v3",
    "megatron_gspo.megatron.glm4_moe": "megatron_gspo.megatron.models.glm4_moe",
    "megatron_gspo.megatron.gpt_oss": "megatron_gspo.megatron.models.gpt_oss",
    "megatron_gspo.megatron.lora_io": "megatron_gspo.megatron.lora.io",
    "megatron_gspo.megatron.lora_export": "megatron_gspo.megatron.io.lora_to_peft",
    "megatron_gspo.megatron.memory_plan": "megatron_gspo.megatron.memory.plan",
    "megatron_gspo.megatron.memory_report": "megatron_gspo.megatron.memory.report",
    "megatron_gspo.megatron.offload": "megatron_gspo.megatron.memory.offload",
    "megatron_gspo.megatron.router_replay": "megatron_gspo.megatron.moe.router_replay",
    "megatron_gspo.megatron.routing_exchange": "megatron_gspo.megatron.moe.routing_exchange",
    "megatron_gspo.megatron.checkpoint_io": "megatron_gspo.megatron.io.dist_checkpoint",
    "megatron_gspo.megatron.async_save": "megatron_gspo.megatron.io.async_save",
    "megatron_gspo.megatron.child_procs": "megatron_gspo.megatron.io.child_procs",
    "megatron_gspo.megatron.conversion": "megatron_gspo.megatron.io.conversion",
    "megatron_gspo.megatron.export": "megatron_gspo.megatron.io.weight_export",
    "megatron_gspo.megatron.weights": "megatron_gspo.megatron.models.shards",
    "megatron_gspo.rollout.standin_router": "megatron_gspo.rollout.standin.router",
    "megatron_gspo.rollout.standin_server": "megatron_gspo.rollout.standin.server",
    "megatron_gspo.rollout.asynchronous.audit": "megatron_gspo.loop.stale_audit",
    "megatron_gspo.run": "megatron_gspo.runtime",
    "megatron_gspo.loop.sync": "megatron_gspo.loop.weight_sync_phase",
    "megatron_gspo.loop.servers": "megatron_gspo.loop.server_setup",
    "megatron_gspo.rollout.base": "megatron_gspo.rollout.engine",
    "megatron_gspo.rollout.weight_sync": "megatron_gspo.rollout.weight_sync_payloads",
    "megatron_gspo.rollout.multinode.sync": "megatron_gspo.rollout.multinode.weight_sync_nodes",
    "megatron_gspo.rollout.multinode.servers": "megatron_gspo.rollout.multinode.node_servers",
    "megatron_gspo.rollout.sglang.weights": "megatron_gspo.rollout.sglang.weight_sync_endpoints",
    "megatron_gspo.rollout.sglang.delta_sync": "megatron_gspo.rollout.sglang.weight_sync_delta",
    "megatron_gspo.rollout.sglang.servers": "megatron_gspo.rollout.sglang.lifecycle",
    "megatron_gspo.rollout.sglang.compat": "megatron_gspo.rollout.sglang.versions",
    "megatron_gspo.rollout.standin.weights": "megatron_gspo.rollout.standin.weight_sync_server",
    "megatron_gspo.megatron.io.export": "megatron_gspo.megatron.io.weight_export",
    "megatron_gspo.megatron.io.checkpoint": "megatron_gspo.megatron.io.dist_checkpoint",
    "megatron_gspo.megatron.models.weights": "megatron_gspo.megatron.models.shards",
    "megatron_gspo.megatron.models.mtp": "megatron_gspo.megatron.models.mtp_block",
    "megatron_gspo.megatron.logprobs": "megatron_gspo.megatron.tp_logprobs",
    "megatron_gspo.convert.base": "megatron_gspo.convert.param_map",
    "megatron_gspo.agent.tools.base": "megatron_gspo.agent.tools.toolset",
    "megatron_gspo.study.runner": "megatron_gspo.study.arms",
    "megatron_gspo.study.report": "megatron_gspo.study.study_report",
    "megatron_gspo.rewards.registry": "megatron_gspo.rewards.scoring",
    "megatron_gspo.cli.plan": "megatron_gspo.cli.plan_checks",
}
# The old `run` package moved as a whole; its checkpoint module was renamed on the way.
_PACKAGE_NOTES = {"megatron_gspo.run": " (run.checkpoint is runtime.run_checkpoint)"}


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Turns an import of an old module path into an ImportError naming the new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            note = _PACKAGE_NOTES.get(fullname, "")
            raise ImportError(f"{fullname} moved to {MOVED[fullname]}{note}: import that instead",
                              name=fullname)
        return None


if not any(type(f).__name__ == "_MovedFinder" and type(f).__module__ == __name__
           for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())
