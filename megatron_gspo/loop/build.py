"""Objects of a training run, built from the config: the learner, the rollout engine, the
tokenizer, the prompt stream, the reward scorer, the initial weights and the run directory.

The RL loop (`train.py`) calls these once at start-up and the phases in `phases.py` each step.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.config import Config, ConfigError
from megatron_gspo.loop.early_checks import check_rows, is_moe
from megatron_gspo.loop import mtp_setting, resume_checks, speculative_setting
from megatron_gspo.loop.server_setup import sglang_engine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_rank0() -> bool:
    """True on global rank 0 (torchrun's RANK before torch.distributed starts)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def resolve_run_dir(run_dir: str | None, config_path: str | None) -> Path:
    """RUN_DIR: as given, else runs/<config file stem>."""
    if run_dir:
        return Path(run_dir)
    stem = Path(config_path).stem if config_path else "run"
    parent = Path(config_path).parent.name if config_path else ""
    return Path("runs") / (f"{parent}-{stem}" if parent else stem)


def read_hf_config(model_path: str | None) -> dict:
    """The model's Hugging Face config.json as a dict (one-line errors naming model.path)."""
    from megatron_gspo.convert.param_map import ConversionError
    from megatron_gspo.convert.hf_io import read_config

    if not model_path:
        raise ConfigError("model.path: required (a Hugging Face model directory)")
    try:
        cfg = read_config(model_path)
    except ConversionError as e:
        raise ConfigError(f"model.path: {model_path} has no usable config.json ({e})") from None
    if isinstance(cfg, dict) and not cfg.get("architectures"):  # name what to add
        from megatron_gspo.convert.registry import get_adapter

        mt = cfg.get("model_type")
        try:
            hint = f'add "architectures": ["{get_adapter(cfg).architectures[0]}"] (its ' \
                   f"model_type is {mt!r})"
        except ConversionError as e:
            hint = f"add the model's architecture (model_type {mt!r}: {e})"
        raise ConfigError(f"model.path: {model_path}/config.json has no \"architectures\" "
                          f"key; {hint}")
    return cfg


def learner(cfg: Config, hf_config: dict):
    """The Megatron-Core learner of this rank (starts torch.distributed and parallel state)."""
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.lora.adapters import LoraSettings
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.parallel import ParallelLayout, configure_timeouts
    from megatron_gspo.megatron.step import LossSettings

    hf_config = mtp_setting.run_config(cfg, hf_config)  # `model.mtp_layers: add` declares it
    p, o, a = cfg.parallel, cfg.optimizer, cfg.algorithm
    configure_timeouts(p.timeout, p.rank0_wait_timeout)
    lo, hi = a.clip_range()
    layout = ParallelLayout(tensor=p.tensor, pipeline=p.pipeline,
                            virtual_pipeline=p.virtual_pipeline, expert=p.expert,
                            expert_tensor=p.expert_tensor, context=p.context,
                            sequence_parallel=p.sequence_parallel)
    total = max(cfg.train.max_steps * a.mini_batches, o.lr_warmup_steps + 1)
    optim = OptimSettings(lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                          adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                          clip_grad=o.clip_grad, warmup_steps=o.lr_warmup_steps,
                          total_steps=total, decay_style=o.lr_decay_style,
                          use_distributed_optimizer=o.distributed_optimizer,
                          mtp_lr=a.mtp_lr or None)
    loss = LossSettings(kind=a.loss, eps_low=lo, eps_high=hi, grpo_aggregation=a.grpo_aggregation,
                        temperature=cfg.rollout.temperature, logratio_bound=a.logratio_bound,
                        kl_coef=a.kl_coef if a.kl_in == "loss" else 0.0,
                        kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef,
                        tau_pos=a.sapo_tau_pos, tau_neg=a.sapo_tau_neg,
                        offpolicy_mask_delta=cfg.precision.offpolicy_mask_delta,
                        norm_length=float(cfg.rollout.max_new_tokens),
                        mtp_weight=a.mtp_loss_weight)
    use_te = {"auto": None, "local": False, "transformer_engine": True}[cfg.model.transformer_impl]
    lo = cfg.model.lora
    lora = LoraSettings(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout,
                        targets=tuple(lo.targets)) if lo.rank else None
    if lora is not None and "experts" in lora.targets and not is_moe(hf_config):
        raise ConfigError(f"model.lora.targets: 'experts', but {cfg.model.path} is a dense model "
                          "(no routed experts); use qkv, proj, fc1, fc2")
    mtp = mtp_setting.mtp_layers(cfg, hf_config)
    speculative_setting.check(cfg, mtp, is_moe(hf_config))  # rollout.speculative needs them
    learner_ = Learner(hf_config, layout=layout, optim=optim, loss=loss,
                   model_kwargs=deterministic_switches(cfg.train.deterministic),
                   batching=BatchSettings(max_tokens_per_microbatch=a.micro_batch_tokens,
                                          pad_id=int(hf_config.get("pad_token_id") or 0)),
                   params_dtype=DTYPES[cfg.model.dtype], seed=cfg.train.seed, use_te=use_te,
                   recompute=cfg.model.recompute_activations, reference=a.kl_coef > 0,
                   reference_offload=cfg.model.reference_offload,
                   routing_replay=cfg.moe.routing_replay,
                   offload_outside_step=o.offload_outside_step, lora=lora,
                   mtp=mtp)
    mtp_setting.mark_sync(learner_, cfg)  # what the weight sync sends of them
    # the initial weights, recorded in checkpoints (the base named in LoRA checkpoints), and
    # what a checkpoint must match to be resumed (`Checkpointer.load` runs it first)
    learner_.model_source = cfg.model.load_checkpoint or cfg.model.path
    if lora is not None:
        learner_.lora_base = learner_.model_source
    learner_.resume_check = functools.partial(resume_checks.check_resume, cfg, hf_config)
    return learner_


def deterministic_switches(on: bool) -> dict:
    """With `train.deterministic`: torch's deterministic algorithms (also for the embedded
    engine), cuDNN without autotuning, cuBLAS's reproducible workspace, NCCL's ring algorithm
    (other algorithms need not reduce in one fixed order; NCCL reads it when the communicators
    start, so this runs before the learner starts torch.distributed) and, returned as
    TransformerConfig fields, Megatron-Core's `deterministic_mode` (TE attention then needs
    NVTE_ALLOW_NONDETERMINISTIC_ALGO=0). Variables already set are kept. {} when off."""
    if not on:
        return {}
    for var, value in (("CUBLAS_WORKSPACE_CONFIG", ":4096:8"), ("NCCL_ALGO", "Ring"),
                       ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")):
        os.environ.setdefault(var, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return {"deterministic_mode": True}


def load_initial_weights(cfg: Config, learner_, hf_config: dict) -> None:
    """Fill the learner from `model.load_checkpoint` (Megatron dist checkpoint) or from the
    safetensors in `model.path`."""
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.convert.registry import get_adapter
    from megatron_gspo.megatron.io import dist_checkpoint as checkpoint_io

    if cfg.model.load_checkpoint:
        resume_checks.check_load_checkpoint(cfg, hf_config)  # another model: one line
        checkpoint_io.load_checkpoint(learner_.chunks, cfg.model.load_checkpoint)
    else:
        hf_config = mtp_setting.run_config(cfg, hf_config)
        adapter = get_adapter(hf_config)
        dims = adapter.dims(checkpoint_io.normalize_hf_config(hf_config))
        reader = HFCheckpointReader(cfg.model.path)
        added = cfg.model.mtp_layers == "add"  # not in model.path: initialised from the trunk
        try:
            with torch.no_grad():
                checkpoint_io.load_hf_weights(learner_.chunks, reader, adapter, dims,
                                              skip_mtp=added)
        finally:
            reader.close()
        if added:
            from megatron_gspo.megatron.models.mtp_block import init_added_mtp

            for m in learner_.chunks:
                init_added_mtp(m)
    learner_._refresh_main_params()


def load_reference(cfg: Config, learner_, hf_config: dict) -> int:
    """Fill the frozen KL reference from `model.reference_path`, else from the initial weights
    (`model.load_checkpoint` or `model.path`): the same on a fresh start and on resume, so the
    reference never depends on the run checkpoint. No-op without a reference (kl_coef 0).

    Returns:
        bytes of this rank's reference parameters (0 when none is built).
    """
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.convert.registry import get_adapter
    from megatron_gspo.megatron.io import dist_checkpoint as checkpoint_io

    chunks = learner_.reference_chunks
    if chunks is None:
        return 0
    path = cfg.model.reference_path
    if path is None and cfg.model.load_checkpoint:
        resume_checks.check_load_checkpoint(cfg, hf_config)
        checkpoint_io.load_checkpoint(chunks, cfg.model.load_checkpoint)
        return learner_.reference_bytes()
    path = path or cfg.model.path
    ref_cfg = read_hf_config(path) if cfg.model.reference_path else hf_config
    adapter = get_adapter(ref_cfg)
    dims = adapter.dims(checkpoint_io.normalize_hf_config(ref_cfg))
    reader = HFCheckpointReader(path)
    try:
        with torch.no_grad():
            checkpoint_io.load_hf_weights(chunks, reader, adapter, dims)
    finally:
        reader.close()
    return learner_.reference_bytes()


def tokenizer(cfg: Config):
    """The Hugging Face tokenizer of `model.tokenizer` (default `model.path`), carrying the stop
    ids of `model.path`'s generation_config.json as `generation_stop_ids`."""
    from transformers import AutoTokenizer

    from megatron_gspo.rollout.generation_config import generation_stop_ids

    path = cfg.model.tokenizer or cfg.model.path
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer: cannot load a tokenizer from {path}: "
                          f"{str(e).splitlines()[0]}") from None
    try:  # the model's generation_config.json stop ids (`SamplingParams.for_rollouts`)
        tok.generation_stop_ids = generation_stop_ids(cfg.model.path) if cfg.model.path else []
    except ValueError as e:
        raise ConfigError(f"model.path: {e}") from None
    return tok


STANDIN_MODULE = "megatron_gspo.rollout.standin.server"


def rollout_engine(cfg: Config, hf_config: dict, tok, served_path: str | None = None):
    """The embedded engine (in-process) or SGLang servers (launched or attached). With
    colocated servers on several nodes (`colocated_on_every_node`): collective, rank 0 gets the
    engine over all nodes, the other node leaders their node's servers, other ranks None.
    `served_path`: the folder launched servers load (default model.path; FP8 rollouts: the
    FP8 copy)."""
    from megatron_gspo.rollout.engine import SamplingParams

    r = cfg.rollout
    sampling = SamplingParams.for_rollouts(r, tok)
    if r.engine == "embedded":
        from megatron_gspo.rollout.embedded import EmbeddedEngine

        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return EmbeddedEngine(dict(hf_config), dtype=r.dtype, device=device, seed=cfg.train.seed,
                              default_sampling=sampling,
                              return_routing=cfg.moe.engine_routing and is_moe(hf_config),
                              **speculative_setting.embedded_kwargs(cfg))
    return sglang_engine(cfg, sampling, hf_config=hf_config, model_path=served_path)


def async_producer(cfg: Config, engine, prompts, score, tok, start_step: int):
    """The producer of asynchronous rollouts (`rollout.mode: async`), not yet started."""
    from megatron_gspo.rollout.asynchronous.producer import AsyncProducer
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams

    r = cfg.rollout

    def to_request(item):
        return GenerateRequest(prompt_ids=list(item.prompt_ids), prompt=item.prompt,
                               label=item.label, metadata={"row": item.row})

    episodes = episode_metrics = None
    if cfg.agent.enabled:
        from megatron_gspo.agent.loop import make_runner
        from megatron_gspo.agent.runner import episode_metrics

        def episodes(eng, requests, group_size):
            items = [{**dict(q.metadata), "prompt": q.prompt, "label": q.label}
                     for q in requests]
            return make_runner(cfg, eng, tok).run_batch_sync(items, n_per_prompt=group_size)

    return AsyncProducer(engine, prompts, to_request, score, SamplingParams.for_rollouts(r, tok),
                         group_size=r.group_size, groups_per_step=cfg.train.prompts_per_step,
                         max_staleness=r.max_staleness, max_steps=cfg.train.max_steps,
                         start_step=start_step, update_in_flight=r.update_in_flight,
                         chunk_tokens=r.chunk_tokens,
                         drop_zero_variance=r.drop_zero_variance_groups, episodes=episodes,
                         episode_metrics=episode_metrics)


def _dataset(cfg: Config, tok, path: str, split: str | None = None):
    from megatron_gspo.data.datasets import PromptDataset

    d = cfg.data
    ds = PromptDataset.from_file(path, tok, prompt_key=d.prompt_key, label_key=d.label_key,
                                 system_prompt=d.system_prompt,
                                 apply_chat_template=d.apply_chat_template,
                                 max_prompt_length=d.max_prompt_length,
                                 skip_bad_rows=d.skip_bad_rows,
                                 split=split or d.train_split, dataset_config=d.dataset_config)
    # labels the scorer cannot read, prompts with no room in the context: bad rows
    check_rows(cfg, ds, read_hf_config(cfg.model.path) if cfg.model.path else None)
    if cfg.agent.enabled:
        from megatron_gspo.agent.loop import check_opening_prompts

        check_opening_prompts(cfg, tok, ds.items)  # room under agent.max_total_tokens
    return ds


def prompt_stream(cfg: Config, tok):
    """Endless, seeded, resumable stream of prompts from `data.train_path`."""
    from megatron_gspo.data.datasets import PromptIterator

    if not cfg.data.train_path:
        raise ConfigError("data.train_path: required")
    return PromptIterator(_dataset(cfg, tok, cfg.data.train_path), seed=cfg.train.seed,
                          shuffle=cfg.data.shuffle)


def eval_prompts(cfg: Config, tok):
    """The eval sets: {name: first `train.eval_prompts` rows}, "" for `data.eval_path` and each
    name of `data.eval_sets` (None when none is configured)."""
    paths = ({"": cfg.data.eval_path} if cfg.data.eval_path else {}) | dict(cfg.data.eval_sets)
    if not paths:
        return None
    sets = {}
    for name, path in paths.items():
        ds = _dataset(cfg, tok, path, cfg.data.eval_split)
        sets[name] = [ds[i] for i in range(min(len(ds), cfg.train.eval_prompts))]
    return sets


def reward_scorer(cfg: Config, tok):
    """A callable that fills `Sample.reward` from the decoded response and the label (by the
    HTTP service of `reward.url` when set, else by the function `reward.name`)."""
    from megatron_gspo.rewards import get_reward_fn, score_samples

    kwargs = dict(cfg.reward.kwargs)

    def detok(ids):
        return tok.decode(ids, skip_special_tokens=True)

    r = cfg.reward
    if r.url:
        from megatron_gspo.rewards.remote import RewardService

        service = RewardService(r.url, batch_size=r.url_batch_size,
                                concurrency=r.url_concurrency, timeout_s=r.url_timeout,
                                retries=r.url_retries, backoff_s=r.url_backoff, kwargs=kwargs)
        return lambda samples: service.score(samples, detok)
    fn = get_reward_fn(cfg.reward.name)

    def score(samples) -> None:  # a reward that fails on a sample fails that sample only
        score_samples(samples, fn, detok, kwargs, mark_failed=True)

    return score
