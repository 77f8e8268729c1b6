"""The start-up phase of a run: everything before the loop's first step, in the order it must
happen, returned as one `Started` record that `loop/train.py` reads.

    inputs (config, tokenizer, data, rewards; checked before anything expensive) -> learner
    -> weights (a verified checkpoint, or the initial weights; the KL reference) -> rollout
    engine (the learner offloaded first when SGLang shares its GPUs) -> metrics log and the
    start-up notes -> the first weight sync -> async producer and async checkpoint saves

Every object with a life (the learner, the engine and its servers, the log, the producer, the
background saves) registers its stop on `cleanup`, so a run that fails during start-up stops
what it had started.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.algo.precision import ToleranceController
from megatron_gspo.config import Config, to_dict
from megatron_gspo.loop import build, early_checks, fp8_rollout, mtp_setting, phases, resume_checks
from megatron_gspo.loop import server_setup as servers
from megatron_gspo.loop import weight_sync_phase as sync
from megatron_gspo.megatron.fallbacks import fallback_summary
from megatron_gspo.rollout.multinode import colocated as colocated_sync
from megatron_gspo.runtime import device_ledger
from megatron_gspo.runtime.metrics import MetricsLogger
from megatron_gspo.runtime.run_checkpoint import Checkpointer
from megatron_gspo.runtime.rundir import RunDirLock


@dataclass
class Started:
    """What the loop needs, made by `start_run`. `None` where a rank does not hold it (rank 0
    holds the prompts, rewards and evaluation sets; the engine is rank 0's and, with colocated
    servers on every node, each node leader's)."""

    hf_config: dict
    rank0: bool
    tokenizer: object
    prompts: object | None
    reward: object | None
    evals: object | None
    learner: object
    controller: ToleranceController
    ckpt: Checkpointer
    start: int  # the first step to run (a resumed run's checkpoint step)
    engine: object | None
    every_node: bool  # colocated servers on every node
    offload: bool  # the learner leaves the GPU while the servers generate
    log: MetricsLogger
    producer: object | None  # rollout.mode async
    saves: object | None  # checkpoint.async_save


def start_run(cfg: Config, run_dir: Path, ckpt_root: Path, lock: RunDirLock | None,
              cleanup: ExitStack, restart_note: str = "") -> Started:
    """The start-up phase (module docstring); `cleanup` stops what it starts.

    Args:
        lock: rank 0's run-dir lock (None on other ranks): its take-over note is logged.
        restart_note: the note of a round torchrun restarted ("" otherwise).
    """
    hf_config = mtp_setting.run_config(cfg, build.read_hf_config(cfg.model.path))  # MTP add
    rank0 = build.is_rank0()
    tokenizer = build.tokenizer(cfg)  # inputs are checked before the expensive parts
    early_checks.check_inputs(cfg, hf_config, tokenizer)
    prompts = build.prompt_stream(cfg, tokenizer) if rank0 else None
    reward = build.reward_scorer(cfg, tokenizer) if rank0 else None
    evals = build.eval_prompts(cfg, tokenizer) if rank0 else None
    learner = build.learner(cfg, hf_config)  # starts torch.distributed + Megatron parallel state
    cleanup.callback(learner.shutdown)
    controller = ToleranceController(cfg.precision.old_logprobs, cfg.precision.audit_fraction,
                                     cfg.precision.tolerance, cfg.precision.recheck_interval)
    ckpt = Checkpointer(ckpt_root, cfg.checkpoint.keep_last, cfg.checkpoint.checksums)
    ckpt.clean_partial()

    start, latest, state, changes = _weights(cfg, learner, hf_config, ckpt, controller, prompts)
    ref_bytes = build.load_reference(cfg, learner, hf_config)  # initial weights, also on resume
    if rank0:  # the device-memory ledger (when installed) models rank 0's GPU
        device_ledger.note("moment", "resume" if latest is not None else "start-up")
        cleanup.callback(device_ledger.write_report)
    learner.note_memory()

    every_node = servers.colocated_on_every_node(cfg)
    offload = sync.offloading(cfg)  # rollout.offload_learner: SGLang gets the whole GPU
    engine = _engine(cfg, learner, hf_config, tokenizer, rank0 or every_node, offload, cleanup,
                     run_dir)
    phases.wait_for_rank0()  # rank 0's servers may take long to start

    log = MetricsLogger(run_dir, enabled=rank0, total_steps=cfg.train.max_steps,
                        start_step=start, tensorboard=cfg.logging.tensorboard,
                        wandb_project=cfg.logging.wandb_project, wandb_name=cfg.logging.wandb_name,
                        progress_bar=cfg.logging.progress_bar, config=to_dict(cfg))
    cleanup.callback(log.close)
    if rank0:
        segment = resume_checks.save_segment_config(cfg, run_dir)  # an earlier one kept
        notes = [restart_note, lock.takeover_note] + ckpt.take_events() + [segment, changes]
        for note in notes:  # restart, stale lock, damaged checkpoints, config changes
            if note:
                log.event(note)
        log.event(f"run dir {run_dir}; " + (f"resumed from {latest.path} at step {start}"
                                            if latest else "starting from the initial weights"))
        for note in _setting_notes(cfg, learner, ref_bytes):
            log.event(note)

    sync.sync_weights(learner, engine, hf_config, cfg, version=start,
                      event=log.event if rank0 else None)
    producer = None  # rollout.mode async: generation overlaps training (rollout/asynchronous)
    if rank0 and cfg.rollout.mode == "async":
        producer = build.async_producer(cfg, engine, prompts, reward, tokenizer, start)
        cleanup.callback(producer.close)
        if latest is not None and state.get("async"):
            producer.load_state_dict(state["async"])  # finished groups kept, in-flight redone
        producer.start()
    saves = None  # checkpoint.async_save: learner files written while training goes on
    if cfg.checkpoint.async_save:
        from megatron_gspo.megatron.io.async_save import AsyncSaves

        saves = AsyncSaves()
        if rank0:  # after `close` below: a publish it waited for is logged too
            cleanup.callback(lambda: [log.event(n) for n in ckpt.take_events()])
        cleanup.callback(saves.close)  # an unfinished save of a failed run stays partial
    return Started(hf_config, rank0, tokenizer, prompts, reward, evals, learner, controller, ckpt,
                   start, engine, every_node, offload, log, producer, saves)


def _weights(cfg: Config, learner, hf_config: dict, ckpt: Checkpointer,
             controller: ToleranceController, prompts):
    """The learner's weights: the latest verified checkpoint (`train.resume: auto`, with the
    data cursor and the precision controller), else the initial weights.

    Returns:
        (first step, the checkpoint resumed or None, its state or None, the config-change note).
    """
    latest = ckpt.resume_point() if cfg.train.resume == "auto" else None  # verified
    changes = resume_checks.config_changes(cfg, latest.path) if latest else ""  # or refused
    if cfg.model.lora.rank:  # LoRA checkpoints hold the adapters: the base comes first
        build.load_initial_weights(cfg, learner, hf_config)
    if latest is None:
        if not cfg.model.lora.rank:
            build.load_initial_weights(cfg, learner, hf_config)
        return 0, None, None, changes
    state = ckpt.load(latest.path, learner, verified=True)
    early_checks.check_resume_mode(cfg, state, latest.path)  # async groups not skipped
    if prompts is not None:
        prompts.load_state_dict(state["data"])
    controller.load_state_dict(state["precision"])
    return state["step"], latest, state, changes


def _engine(cfg: Config, learner, hf_config: dict, tokenizer, holds_engine: bool,
            offload: bool, cleanup: ExitStack, run_dir: Path):
    """Rank 0's engine; with colocated servers on several nodes every node leader also holds
    its node's servers (built collectively). Started once the learner holds its weights, so
    that an offloaded learner leaves SGLang the whole GPU. FP8 rollouts: launched servers
    start from the FP8 copy of model.path (`fp8_rollout.served_checkpoint`)."""
    served = None
    if (holds_engine and fp8_rollout.enabled(cfg) and cfg.rollout.engine == "sglang"
            and not cfg.rollout.server_urls):
        served = fp8_rollout.served_checkpoint(cfg, run_dir, fp8_rollout.this_node())
    if offload:  # and its cache returned: SGLang sizes its KV cache from the free memory
        learner.offload()
        colocated_sync.free_learner_cache()
    engine = (build.rollout_engine(cfg, hf_config, tokenizer, served) if holds_engine
              else None)
    if engine is not None and sync.colocated_sglang(cfg):
        device_ledger.note("sglang_launch")
        # the first sync runs as every later one: the servers hold only their weights while
        # the learner brings its weights back and exports them
        engine.release_memory(colocated_sync.RESUME_AFTER)
    if engine is not None:
        cleanup.callback(engine.shutdown)  # launched servers stop, also on errors
        if fp8_rollout.enabled(cfg) and cfg.rollout.engine == "sglang":
            fp8_rollout.check_served(engine)  # attached servers: an FP8 checkpoint
    return engine


def _setting_notes(cfg: Config, learner, ref_bytes: int) -> list[str]:
    """Start-up notes on settings: TE / apex fallbacks, where the KL reference lives, GRPO with
    engine log-probs."""
    notes = [fallback_summary()]  # replaces Megatron-Core's TE / apex import warnings
    if cfg.algorithm.kl_coef > 0 and cfg.model.lora.rank:
        notes.append("KL reference: the base model, the learner with its LoRA adapters off "
                     "(no second model)")
    elif cfg.algorithm.kl_coef > 0:
        where = "CPU between uses" if cfg.model.reference_offload else str(learner.device)
        notes.append(f"KL reference ({cfg.model.reference_path or 'initial weights'}, frozen): "
                     f"{ref_bytes / 2**20:.1f} MiB of parameters on rank 0, kept on {where}")
    if cfg.algorithm.loss == "grpo" and cfg.precision.old_logprobs != "recompute":
        notes.append("warning: GRPO's token-level ratios tolerate engine/learner mismatch less "
                     "than GSPO's sequence ratios; the audit reports per-token numbers")
    return [n for n in notes if n]
