"""Speculative decoding of launched SGLang servers from the model's multi-token-prediction (MTP)
head (`rollout.speculative.algorithm: mtp`; DeepSeek-V3 report arXiv 2412.19437 section 2.2,
EAGLE-style chain verification): the launch flags, the families it is refused for, the
draft's memory, and what a weight sync must do so that the draft follows the policy.

Launch (read in both supported releases, paths under python/sglang/srt/):
- `--speculative-algorithm NEXTN`: 0.5.12 server_args.py `_resolve_speculative_algorithm_alias`
  and 0.5.23 arg_groups/speculative_hook.py (same function) turn it into EAGLE; the draft model
  class is chosen by configs/model_config.py `_config_draft_model` (DeepseekV3ForCausalLM ->
  DeepseekV3ForCausalLMNextN, Glm4MoeForCausalLM -> Glm4MoeForCausalLMNextN, in both).
- `--speculative-draft-model-path` is left out: for DeepSeek-V3 / GLM-4.5 both releases default
  it to the target (0.5.12 server_args.py `_handle_speculative_decoding`, 0.5.23
  speculative_hook.py `_handle_eagle_family`) and warn when it is given. Qwen3-Next's draft
  class exists (Qwen3NextForCausalLMMTP) but its path is not defaulted, and the learner builds
  no Qwen3-Next MTP layer: refused here (the draft could never be synced).
- `--speculative-num-steps`, `--speculative-eagle-topk`, `--speculative-num-draft-tokens`: with
  top-k 1 both releases silently reset the draft tokens to steps + 1 (a warning), so another
  value is refused here, as an ignored setting. Both cap `--max-running-requests` at 48 unless
  it is given (a warning); the CPU engine's `--disable-overlap-schedule` selects spec v1
  (`EAGLEWorker`) at 0.5.12 and synchronous spec v2 (`EAGLEWorkerV2`) at 0.5.23.
- Measured with each release's `prepare_server_args` (tests/rollout/test_speculative_sglang_
  launch.py). The real CPU server of neither release can draft: its KV pool's KV-copy kernel
  warm-up ends the scheduler at start (docs/weight-sync.md "Speculative servers").

Draft weights per weight path (docs/weight-sync.md "Draft weights"):
- tensor: 0.5.12 speculative/eagle_worker.py `EAGLEWorker.update_weights_from_tensor` loads the
  same named tensors into the draft runner, then the target; 0.5.23 managers/scheduler_
  components/weight_updater.py `update_weights_from_tensor` into every runner of
  `_select_runners("all")`. A custom loader is called once per runner with that runner's model.
- disk: 0.5.12 managers/scheduler_update_weights_mixin.py `update_weights_from_disk` calls the
  draft worker after the target; 0.5.23 weight_updater.py fans out to every runner.
- distributed: 0.5.12 scheduler_update_weights_mixin.py `update_weights_from_distributed` calls
  the target worker only (sglang issue #27718): the draft keeps its start weights. 0.5.23
  (weight_updater.py, sglang PR #28575) receives the broadcast once on the target and loads it
  into every selected runner (selector "all" by default). For 0.5.12 the project's loader
  links them: `LINK` (gspo_delta_loader.link_draft), called through the tensor path once per
  sync, records the draft model and makes the target's `load_weights` hand the MTP layers'
  tensors to it (`draft_link_needed`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

SPEC_PREFIX = "--speculative-"
#: the name passed; both releases alias it to EAGLE (see module docstring)
ALGORITHM = "NEXTN"
#: `/server_info` values of a server drafting with EAGLE / NEXTN (after the alias)
DRAFTING = ("EAGLE", "NEXTN")
#: the project's custom loader that links the draft to the target's load_weights (0.5.12)
LINK = "gspo_delta_loader.link_draft"
LOADER_FLAG = "--custom-weight-loader"

#: SGLang's NEXTN draft class of each family whose MTP layers the learner builds and syncs
#: (configs/model_config.py `_config_draft_model`, 0.5.12 and 0.5.23).
DRAFT_CLASSES = {"DeepseekV3ForCausalLM": "DeepseekV3ForCausalLMNextN",
                 "Glm4MoeForCausalLM": "Glm4MoeForCausalLMNextN"}
#: Draft classes SGLang has for families whose MTP layers the learner does not build.
UNSYNCED_DRAFTS = {
    "Qwen3NextForCausalLM": "Qwen3NextForCausalLMMTP",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLMMTP",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5ForCausalLMMTP",
    "Qwen3MoeForCausalLM": "Qwen3MoeForCausalLMMTP (0.5.23 only)",
    "DeepseekV32ForCausalLM": "DeepseekV3ForCausalLMNextN",
    "GlmMoeDsaForCausalLM": "GlmMoeDsaForCausalLMNextN",
}


def draft_refusal(arch: str) -> str | None:
    """Why a launched SGLang server of `arch` cannot draft with a synced MTP head, or None."""
    if arch in DRAFT_CLASSES:
        return None
    if arch in UNSYNCED_DRAFTS:
        return (f"SGLang drafts {arch} with {UNSYNCED_DRAFTS[arch]}, but the learner builds no "
                f"MTP layer of {arch} (DeepSeek-V3 and GLM-4.5 only), so the draft could never "
                "be synced")
    return (f"SGLang 0.5.12 / 0.5.23 have no NEXTN draft model for {arch} (models/ holds "
            "draft classes for DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5, MiMo, ... only; "
            "configs/model_config.py _config_draft_model), so an MTP head added by the learner "
            "cannot be served as a draft")


def speculative_server_args(arch: str, num_steps: int, topk: int,
                            num_draft_tokens: int | None,
                            extra_args: Sequence[str] = ()) -> list[str]:
    """The speculative flags of a launched server (rollout.speculative.algorithm mtp).

    Args:
        arch: the model's `architectures[0]`.
        num_steps, topk, num_draft_tokens: rollout.speculative's (None: num_steps + 1).
        extra_args: rollout.extra_server_args (none of them may be a --speculative-* flag).
    Returns:
        the flags, to add to the server's command line.
    Raises:
        ValueError: one line naming what is wrong.
    """
    own = next((a.split("=", 1)[0] for a in extra_args if a.startswith(SPEC_PREFIX)), None)
    if own is not None:
        raise ValueError(f"rollout.extra_server_args: {own} together with rollout.speculative "
                         "(the launcher passes the speculative flags from rollout.speculative); "
                         "drop one")
    bad = draft_refusal(arch)
    if bad:
        raise ValueError(f"rollout.speculative.algorithm: mtp on launched SGLang servers: {bad}")
    tokens = num_steps + 1 if num_draft_tokens is None else num_draft_tokens
    if topk == 1 and tokens != num_steps + 1:
        raise ValueError(f"rollout.speculative.num_draft_tokens: {tokens} with topk 1, but SGLang "
                         f"verifies a chain of num_steps + 1 = {num_steps + 1} tokens (it resets "
                         "any other value); leave it unset")
    if topk > 1 and not num_steps < tokens <= num_steps * topk + 1:
        raise ValueError(f"rollout.speculative.num_draft_tokens: {tokens} outside "
                         f"({num_steps}, {num_steps * topk + 1}] for num_steps {num_steps} and "
                         f"topk {topk} (a tree of the draft's top-{topk} branches)")
    return ["--speculative-algorithm", ALGORITHM, "--speculative-num-steps", str(num_steps),
            "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(tokens)]


def link_launch_extras(extra: Sequence[str], env: dict[str, str], folder: str | None = None
                       ) -> tuple[tuple[str, ...], dict[str, str]]:
    """`extra` and `env` of a launched server with `LINK` among its custom weight loaders (the
    loader's folder on PYTHONPATH once): what the distributed path needs at 0.5.12."""
    from megatron_gspo.rollout.sglang.weight_sync_delta import loader_dir

    out = list(extra)
    if LOADER_FLAG in out:  # one flag (argparse nargs="*": a second one would replace it)
        i = out.index(LOADER_FLAG) + 1
        while i < len(out) and not out[i].startswith("--"):
            i += 1
        out.insert(i, LINK)
        return tuple(out), env  # its folder is on PYTHONPATH already (the delta loader's)
    old = env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")
    return (tuple(out) + (LOADER_FLAG, LINK),
            {**env, "PYTHONPATH": loader_dir(folder) + (os.pathsep + old if old else "")})


def drafting(server_info: dict) -> bool:
    """Whether the server of this `/server_info` drafts with an EAGLE / NEXTN draft model."""
    return str(server_info.get("speculative_algorithm") or "").upper() in DRAFTING


def link_refusal(server_info: dict, url: str) -> str | None:
    """Why a distributed sync would leave `url`'s draft stale, or None: a drafting server of a
    release whose broadcast skips the draft (`versions.distributed_reaches_draft`) without
    `LINK` among its `--custom-weight-loader`s."""
    from megatron_gspo.rollout.sglang.versions import distributed_reaches_draft

    if not drafting(server_info) or distributed_reaches_draft(server_info):
        return None
    if LINK in (server_info.get("custom_weight_loader") or ()):
        return None
    return (f"{url} drafts with an MTP head but SGLang {server_info.get('version', '?')}'s "
            "update_weights_from_distributed loads the target only (managers/scheduler_update_"
            f"weights_mixin.py; sglang #27718): launch it with {LOADER_FLAG} {LINK} (the "
            "launcher does) or sync by tensor or disk")


def draft_link_needed(server_info: dict) -> bool:
    """Whether a distributed sync to this server first posts the `LINK` call."""
    from megatron_gspo.rollout.sglang.versions import distributed_reaches_draft

    return drafting(server_info) and not distributed_reaches_draft(server_info) and (
        LINK in (server_info.get("custom_weight_loader") or ()))


def draft_bytes(hf_config: dict, dtype_bytes: int, kv_tokens: int) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) of the NEXTN draft of a DeepSeek-V3 / GLM-4.5 server:
    its own tensors (one MTP layer each: eh_proj [H, 2H], three norms, one decoder layer; the
    embedding and head are the target's), and one layer's KV for `kv_tokens` tokens (the
    draft runner has its own pool of the target's size: speculative/eagle_worker.py).
    A decoder layer of a MoE family is counted with all its routed experts.
    """
    from megatron_gspo.convert.mtp import declared_mtp_layers

    c, n = hf_config, max(declared_mtp_layers(hf_config), 1)
    h = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V3): compressed latent + rope key per token
        qk = int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])
        q = (h * int(c["q_lora_rank"]) + int(c["q_lora_rank"]) * heads * qk
             if c.get("q_lora_rank") else h * heads * qk)
        kv_rank = int(c["kv_lora_rank"])
        attn = q + h * (kv_rank + int(c["qk_rope_head_dim"])) + kv_rank * heads * (
            int(c["qk_nope_head_dim"]) + int(c["v_head_dim"])) + heads * int(c["v_head_dim"]) * h
        kv_per_token = kv_rank + int(c["qk_rope_head_dim"])
    else:  # GQA (GLM-4.5)
        hd = int(c.get("head_dim") or h // heads)
        kvh = int(c.get("num_key_value_heads") or heads)
        attn = h * hd * (heads + 2 * kvh) + heads * hd * h
        kv_per_token = 2 * kvh * hd
    experts = int(c.get("n_routed_experts") or 0) + int(c.get("n_shared_experts") or 0)
    inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size"))
    mlp = 3 * h * inter * max(experts, 1) + (h * int(c.get("n_routed_experts") or 0))
    own = 2 * h * h + 4 * h + attn + mlp  # eh_proj, enorm/hnorm/shared_head.norm/input norm
    return n * own * dtype_bytes, n * kv_per_token * kv_tokens * dtype_bytes
