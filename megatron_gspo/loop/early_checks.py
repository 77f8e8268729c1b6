"""Checks that run before the learner is built, so a wrong setting costs seconds and prints
one line (a ConfigError naming the field) instead of a traceback after minutes of start-up:
the model's architecture, the run and checkpoint directories, the parallel layout against the
world size and the model (upstream refusals included), the weight-sync backend, the KL
reference, the agent environment, chat template and labels, routing replay; once prompts are
tokenized, rows whose label or length the run cannot use.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_gspo.config import Config, ConfigError
from megatron_gspo.runtime import device_ledger

LABEL_REWARDS = ("math", "math_boxed_strict", "exact_match")  # built-ins that need a label


def check_run_dir(run_dir: Path, ckpt_root: Path) -> None:
    """RUN_DIR and the checkpoint root can be created and written (ConfigError otherwise)."""
    import tempfile

    for what, d in (("run dir", Path(run_dir)), ("checkpoint dir", Path(ckpt_root))):
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write_check_", dir=d)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(f"{what} {d} is not writable: {e.strerror or e}") from None


def check_inputs(cfg: Config, hf_config: dict, tok) -> None:
    """Settings that would otherwise fail only once the learner and engine exist: the parallel
    layout against the world size and the model, the chat template, the agent environment and
    its `agent.env_kwargs`, a reward that needs labels when `data.label_key` is null.

    Raises:
        ConfigError naming the field.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device_ledger.active()  # a ledger spec that cannot be read: its one line before any work
    check_model_layout(cfg, hf_config, world)
    check_memory(cfg, hf_config, world)
    check_update_backend(cfg)
    if cfg.agent.enabled:
        _check_agent(cfg)
        _check_agent_chat(cfg, tok)
        _check_agent_context(cfg, hf_config)
    elif cfg.data.apply_chat_template and not getattr(tok, "chat_template", None):
        raise ConfigError("data.apply_chat_template: the tokenizer of "
                          f"{cfg.model.tokenizer or cfg.model.path} has no chat template; set "
                          "data.apply_chat_template=false or use a tokenizer with one")
    if cfg.data.label_key is None and not cfg.agent.enabled and not cfg.reward.url \
            and cfg.reward.name in LABEL_REWARDS:
        raise ConfigError(f"reward.name: {cfg.reward.name!r} compares responses with a label "
                          "but data.label_key is null; set data.label_key or use a reward that "
                          "needs no label")
    if cfg.algorithm.kl_coef > 0 and cfg.model.reference_path:
        _check_reference(cfg.model.reference_path, hf_config)
    if cfg.moe.routing_replay != "none" and not is_moe(hf_config):
        raise ConfigError(f"moe.routing_replay: {cfg.moe.routing_replay!r} needs an MoE model; "
                          f"{cfg.model.path} ({', '.join(hf_config.get('architectures') or [])}) "
                          "has no routed experts")
    if cfg.moe.routing_replay == "r3" and cfg.agent.enabled:
        raise ConfigError("moe.routing_replay: 'r3' is not supported with agent.enabled (the "
                          "episodes' environment tokens have no engine routing); use 'r2'")


def check_model_layout(cfg: Config, hf_config: dict, world: int,
                       model: str | None = None) -> None:
    """The learner can build the model of `hf_config` (`check_model`) in the layout of
    `parallel.*` on `world` ranks (`megatron.parallel.check_layout`: divisibility by the world
    size, heads, layers, experts). Training checks this at start, `megatron-gspo plan` before
    its arithmetic.

    Args:
        model: what to name in errors about the model (default model.path).
    Raises:
        ConfigError naming the field.
    """
    from megatron_gspo.megatron.parallel import ParallelLayout, ParallelLayoutError, check_layout

    check_model(model or cfg.model.path, hf_config)
    p = cfg.parallel
    layout = ParallelLayout(tensor=p.tensor, pipeline=p.pipeline,
                            virtual_pipeline=p.virtual_pipeline, expert=p.expert,
                            expert_tensor=p.expert_tensor, context=p.context,
                            sequence_parallel=p.sequence_parallel)
    try:
        check_layout(layout, world, hf_config)
    except ParallelLayoutError as e:
        raise ConfigError(f"parallel: {e}") from None
    from megatron_gspo.megatron.models.deepseek_v3 import (DeepseekConfigError,
                                                           check_training_layout)

    try:  # refused here, before torch.distributed and any model: one line, not one per rank
        check_training_layout(hf_config, p.tensor, p.sequence_parallel)
    except DeepseekConfigError as e:
        raise ConfigError(f"parallel.tensor: {e}") from None


def check_update_backend(cfg: Config) -> None:
    """A broadcast weight sync (`rollout.weight_sync` distributed, or auto without colocation)
    to servers of `rollout.sglang_device=cuda` runs over NCCL: a torch built without it (a CPU
    wheel) is a ConfigError naming the field, instead of torch's "Distributed package doesn't
    have NCCL built in" at the first sync."""
    import torch.distributed as dist

    r = cfg.rollout
    sync = r.weight_sync if r.weight_sync != "auto" else (
        "tensor" if r.colocate else "distributed")
    if r.engine != "sglang" or sync != "distributed" or r.sglang_device != "cuda":
        return
    if not dist.is_nccl_available():
        import torch

        raise ConfigError(
            f"rollout.sglang_device: 'cuda' sends the weights to the SGLang servers by an NCCL "
            f"broadcast (rollout.weight_sync=distributed), but this torch ({torch.__version__}) "
            "has no NCCL; set rollout.sglang_device=cpu for servers on SGLang's CPU engine "
            "(gloo broadcast), or run the learner with a CUDA build of torch")


def check_memory(cfg: Config, hf_config: dict, world: int, gpu_bytes: int | None = None) -> None:
    """The memory plan (`megatron-gspo plan`) of this layout on this GPU: a ConfigError naming
    the biggest term when it cannot fit. Skipped without CUDA unless `gpu_bytes` is given."""
    from megatron_gspo.megatron.memory.changes import check_before_launch

    if gpu_bytes is None:
        import torch

        if not torch.cuda.is_available():
            return
        gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    check_before_launch(cfg, hf_config, gpu_bytes=gpu_bytes, world=world,
                        gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def check_model(path: str | None, hf_config: dict) -> None:
    """The learner can build the model of `hf_config` (positive sizes, supported architecture,
    activation, biases, rope scaling, head counts): a ConfigError naming model.path otherwise."""
    from megatron_gspo.megatron.models.builder import ModelConfigError, build_model_config

    sizes = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
             "num_key_value_heads", "head_dim", "intermediate_size")
    for key in sizes:  # the required ones are named by build_model_config when missing
        v = hf_config.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"model.path: {path}: config.json {key}={v!r}; expected a "
                              "positive integer")
    try:
        build_model_config(hf_config, use_te=False)
    except ModelConfigError as e:
        raise ConfigError(f"model.path: {path}: {e}") from None


def is_moe(hf_config: dict) -> bool:
    """The model has routed experts (`num_experts` / `num_local_experts` / `n_routed_experts`)."""
    from megatron_gspo.convert.param_map import num_routed_experts

    return bool(num_routed_experts(hf_config))


def _check_reference(path: str, hf_config: dict) -> None:
    """The KL reference is held in the policy's layout: same family and sizes."""
    from megatron_gspo.convert.param_map import ConversionError, dims_from_hf_config
    from megatron_gspo.convert.hf_io import read_config

    try:
        ref = read_config(path)
        diff = [(k, ref.get(k), hf_config.get(k)) for k in ("architectures",)
                if ref.get(k) != hf_config.get(k)]
        mine, theirs = dims_from_hf_config(ref), dims_from_hf_config(hf_config)
    except ConversionError as e:
        raise ConfigError(f"model.reference_path: {path} has no usable config.json ({e})") \
            from None
    diff += [(k, v, getattr(theirs, k)) for k, v in vars(mine).items()
             if v != getattr(theirs, k)]
    if diff:
        k, v, want = diff[0]
        raise ConfigError(f"model.reference_path: {path} is not the policy's architecture ({k} "
                          f"{v!r}, model.path has {want!r}); the KL reference must match it")


def _env_class(cfg: Config):
    from megatron_gspo.agent.env import resolve_env

    try:
        return resolve_env(cfg.agent.environment)
    except ValueError as e:
        raise ConfigError(f"agent.environment: {e}") from None


def _check_agent(cfg: Config) -> None:
    import inspect

    if cfg.data.apply_chat_template:
        raise ConfigError("data.apply_chat_template: must be false with agent.enabled (the "
                          "environment renders the chat from the raw prompt)")
    cls = _env_class(cfg)
    kwargs = dict(cfg.agent.env_kwargs)
    if cfg.agent.python_tool:
        kwargs["python_tool"] = True
        _check_python_sandbox(kwargs.get("python_kwargs"))
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"agent.env_kwargs: {cfg.agent.environment} does not take "
                          f"{sorted(kwargs)}: {e}") from None
    except ValueError:
        pass  # no introspectable signature


def _check_python_sandbox(python_kwargs) -> None:
    """agent.python_tool: the kernel can confine the sandbox (Landlock), or the config says
    the audit hook alone will do."""
    from megatron_gspo.agent.tools.sandbox_os import landlock_abi

    opts = python_kwargs if isinstance(python_kwargs, dict) else {}
    if opts.get("require_landlock", True) and not landlock_abi():
        raise ConfigError(
            "agent.python_tool: this kernel has no Landlock (Linux >= 5.13 with landlock "
            "enabled), so the python sandbox cannot keep reads inside its temp dir; turn the "
            "tool off, or set agent.env_kwargs.python_kwargs.require_landlock: false")


def _check_agent_chat(cfg: Config, tok) -> None:
    """agent.tool_parser resolves; agent.chat_template has a template to use."""
    from megatron_gspo.agent.chat_session import ChatTemplateError, make_chat
    from megatron_gspo.agent.tool_parsers import resolve_tool_parser

    try:
        parser = resolve_tool_parser(cfg.agent.tool_parser)
    except ValueError as e:
        raise ConfigError(f"agent.tool_parser: {e}") from None
    try:
        make_chat(cfg.agent.chat_template, tok, parser)
    except ChatTemplateError as e:
        msg = str(e).removeprefix("agent.chat_template: ")
        raise ConfigError(f"agent.chat_template: {msg}") from None


def check_rows(cfg: Config, ds, hf_config: dict | None) -> None:
    """Rows the run cannot use, found once the prompts are tokenized: a label the scorer cannot
    read (agent mode: the environment's `check_label`; else the reward function's,
    `rewards.scoring.label_check`), a prompt that leaves no room for a response in the model's
    context (`model_context`; None: not checked). Each is a bad row: a DatasetError naming it,
    or with data.skip_bad_rows skipped and counted; no usable row left is an error."""
    from megatron_gspo.data.datasets import DatasetError

    check = _label_check(cfg)
    context = None if hf_config is None else model_context(hf_config)
    keep = []
    for item in ds.items:
        msg = None
        if context is not None and len(item.prompt_ids) >= context:
            msg = (f"prompt has {len(item.prompt_ids)} tokens, which leaves no room for a "
                   f"response in the model's context of {context} tokens")
        elif check is not None:
            try:
                check(item.label)
            except (ValueError, TypeError) as e:
                msg = f"label {item.label!r:.40}: {e}"
        if msg is None:
            keep.append(item)
            continue
        msg = f"{ds.path} row {item.row}: {msg}"
        if not cfg.data.skip_bad_rows:
            raise DatasetError(msg + " (set skip_bad_rows to skip such rows)") from None
        ds.skipped.append(msg)
    if not keep:
        raise DatasetError(f"{ds.path}: no usable rows ({len(ds.skipped)} bad rows skipped)")
    ds.items = keep


def _label_check(cfg: Config):
    """check_label(label) of the scorer of this run, or None (a reward service, no labels)."""
    if cfg.agent.enabled:
        check = getattr(_env_class(cfg), "check_label", None)
        return check if callable(check) else None
    if cfg.reward.url or cfg.data.label_key is None:
        return None
    from megatron_gspo.rewards.scoring import get_reward_fn, label_check

    return label_check(get_reward_fn(cfg.reward.name))


def model_context(hf_config: dict) -> int:
    """Most tokens (prompt and response) the model takes: the context length SGLang derives
    from its config (`rollout.sglang.protocol.context_length_of`)."""
    from megatron_gspo.rollout.sglang.protocol import context_length_of

    return context_length_of(hf_config)


def _check_agent_context(cfg: Config, hf_config: dict) -> None:
    """agent.max_total_tokens fits the model's context."""
    ctx = model_context(hf_config)
    if cfg.agent.max_total_tokens > ctx:
        raise ConfigError(f"agent.max_total_tokens: {cfg.agent.max_total_tokens} is above the "
                          f"context of {cfg.model.path} ({ctx} tokens); use at most {ctx}")


def check_resume_mode(cfg: Config, state: dict, path) -> None:
    """A checkpoint of an asynchronous run that holds finished untrained groups or groups in
    flight resumes only with `rollout.mode: async` (a synchronous run would skip them)."""
    pending = state.get("async") or {}
    if cfg.rollout.mode == "async" or not pending:
        return
    finished, redo = len(pending.get("finished") or []), len(pending.get("redo") or [])
    if finished or redo:
        raise ConfigError(f"rollout.mode: 'sync', but checkpoint {path} was written by an "
                          f"asynchronous run and holds {finished} finished untrained groups and "
                          f"{redo} in flight, which a synchronous run would skip; resume with "
                          "rollout.mode=async")
