"""The GSPO RL loop (arXiv 2507.18071), readable top to bottom:

    sample prompts -> rollout (groups of G) -> rewards -> group advantages -> pi_old (engine
    log-probs or learner recompute, audited) -> optimizer steps over mini-batches -> weight sync
    -> log / eval / checkpoint

Every rank runs this loop. Rank 0 owns the prompts, the rollout engine and the rewards; the
samples are broadcast so every rank trains on the same global batch (the learner picks its
data-parallel share). Helpers live where they belong: `loop/build.py` (objects from the config),
`loop/server_setup.py` (SGLang servers), `loop/phases.py` (each phase of a step),
`runtime/run_checkpoint.py`, `runtime/metrics.py`, `algo/` (the math).
"""

from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

from megatron_gspo.loop import build, early_checks, phases, resume_checks
from megatron_gspo.loop import server_setup as servers
from megatron_gspo.loop import weight_sync_phase as sync
from megatron_gspo.algo.precision import ToleranceController
from megatron_gspo.runtime.run_checkpoint import Checkpointer
from megatron_gspo.config import Config, to_dict
from megatron_gspo.megatron.fallbacks import fallback_summary
from megatron_gspo.megatron.learner_state import CHECKPOINT_PARTS
from megatron_gspo.runtime.metrics import MetricsLogger
from megatron_gspo.rollout.multinode import colocated as colocated_sync
from megatron_gspo.runtime import device_ledger, faults, restarts
from megatron_gspo.runtime.rundir import RunDirLock, RunError, check_start


def run(cfg: Config, run_dir: str | None = None, config_path: str | None = None) -> Path:
    """Train according to `cfg`; returns the run directory.

    Rank 0 holds the run-dir lock (`RUN_DIR/run.lock`, and the checkpoint dir's) for the
    whole run, released also on errors; `train.resume: never` into a run dir that already
    holds a run, or `auto` into one with metrics and no checkpoint, is a RunError.
    Whatever the run started (launched servers, the async producer, process groups) is
    stopped when it ends, also when it ends with an error.
    """
    restarts.die_with_agent()  # under torchrun: no worker outlives its agent
    restarts.check_checkpoint_interval(cfg.checkpoint.interval, cfg.train.max_steps)
    run_dir = build.resolve_run_dir(run_dir, config_path)
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    if restarts.restart_round() > 0:  # torchrun restarted the group: continue the run
        cfg.train.resume = "auto"
    if build.is_rank0():
        early_checks.check_run_dir(run_dir, ckpt_root)
    lock = RunDirLock(run_dir, ckpt_root).acquire() if build.is_rank0() else None
    try:  # a restarted round's note; the same step failing again and again stops it here
        record = restarts.RestartRecord(run_dir)
        if lock is not None:
            record.begin(ckpt_root)
        if not record.starting_over(ckpt_root):  # (restarted before the first checkpoint)
            check_start(run_dir, ckpt_root, cfg.train.resume)  # nothing of an earlier run lost
        with ExitStack() as cleanup:
            return _train(cfg, run_dir, ckpt_root, lock, cleanup, record.note)
    except BaseException as e:  # the cause a restarted round reports
        if not isinstance(e, restarts.RepeatedFailure):
            restarts.note_error(run_dir, e)
        raise
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: Config, run_dir: Path, ckpt_root: Path, lock: RunDirLock | None,
           cleanup: ExitStack, restart_note: str = "") -> Path:
    """The loop itself (see the module docstring); `cleanup` stops what it starts."""
    hf_config = build.read_hf_config(cfg.model.path)
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

    start = 0
    latest = ckpt.resume_point() if cfg.train.resume == "auto" else None  # verified
    changes = resume_checks.config_changes(cfg, latest.path) if latest else ""  # or refused
    if cfg.model.lora.rank:  # LoRA checkpoints hold the adapters: the base comes first
        build.load_initial_weights(cfg, learner, hf_config)
    if latest is not None:
        state = ckpt.load(latest.path, learner, verified=True)
        early_checks.check_resume_mode(cfg, state, latest.path)  # async groups not skipped
        start = state["step"]
        if rank0:
            prompts.load_state_dict(state["data"])
        controller.load_state_dict(state["precision"])
    elif not cfg.model.lora.rank:
        build.load_initial_weights(cfg, learner, hf_config)
    ref_bytes = build.load_reference(cfg, learner, hf_config)  # initial weights, also on resume
    if rank0:  # the device-memory ledger (when installed) models rank 0's GPU
        device_ledger.note("moment", "resume" if latest is not None else "start-up")
        cleanup.callback(device_ledger.write_report)
    learner.note_memory()
    # Rank 0's engine; with colocated servers on several nodes every node leader also holds its
    # node's servers (built collectively). Started once the learner holds its weights, so that
    # an offloaded learner (rollout.offload_learner) leaves SGLang the whole GPU.
    every_node = servers.colocated_on_every_node(cfg)
    offload = sync.offloading(cfg)  # rollout.offload_learner: SGLang gets the whole GPU
    if offload:  # and its cache returned: SGLang sizes its KV cache from the free memory
        learner.offload()
        colocated_sync.free_learner_cache()
    engine = build.rollout_engine(cfg, hf_config, tokenizer) if rank0 or every_node else None
    if engine is not None and sync.colocated_sglang(cfg):
        device_ledger.note("sglang_launch")
        # the first sync runs as every later one: the servers hold only their weights while
        # the learner brings its weights back and exports them
        engine.release_memory(colocated_sync.RESUME_AFTER)
    if engine is not None:
        cleanup.callback(engine.shutdown)  # launched servers stop, also on errors
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
        fallbacks = fallback_summary()  # replaces Megatron-Core's TE / apex import warnings
        if fallbacks:
            log.event(fallbacks)
        if cfg.algorithm.kl_coef > 0 and cfg.model.lora.rank:
            log.event("KL reference: the base model, the learner with its LoRA adapters off "
                      "(no second model)")
        elif cfg.algorithm.kl_coef > 0:
            where = "CPU between uses" if cfg.model.reference_offload else str(learner.device)
            log.event(f"KL reference ({cfg.model.reference_path or 'initial weights'}, frozen): "
                      f"{ref_bytes / 2**20:.1f} MiB of parameters on rank 0, kept on {where}")
        if cfg.algorithm.loss == "grpo" and cfg.precision.old_logprobs != "recompute":
            log.event("warning: GRPO's token-level ratios tolerate engine/learner mismatch less "
                      "than GSPO's sequence ratios; the audit reports per-token numbers")
    sync.sync_weights(learner, engine, hf_config, cfg, version=start,
                        event=log.event if rank0 else None)
    producer = None  # rollout.mode async: generation overlaps training (rollout/async_producer)
    if rank0 and cfg.rollout.mode == "async":
        producer = build.async_producer(cfg, engine, prompts, reward, tokenizer, start)
        cleanup.callback(producer.close)
        if latest is not None and state.get("async"):
            producer.load_state_dict(state["async"])  # finished groups kept, in-flight redone
        producer.start()
    ckpt_s = 0.0  # seconds the loop spent in checkpoint work since the last metrics row
    skipped_in_a_row = 0  # steps whose optimizer updates were all skipped (non-finite)
    saves = None  # checkpoint.async_save: learner files written while training goes on
    if cfg.checkpoint.async_save:
        from megatron_gspo.megatron.io.async_save import AsyncSaves

        saves = AsyncSaves()
        if rank0:  # after `close` below: a publish it waited for is logged too
            cleanup.callback(lambda: [log.event(n) for n in ckpt.take_events()])
        cleanup.callback(saves.close)  # an unfinished save of a failed run stays partial

    for step in range(start, cfg.train.max_steps):
        faults.maybe_kill_rank("kill_at_step", step)  # crash tests (MEGATRON_GSPO_FAULT)
        t_step = time.perf_counter()
        m: dict = {}

        # 1-2. Rollout G responses per prompt and score them (rank 0), then share the batch.
        samples = None
        if rank0:
            samples, rollout_m = phases.rollout(cfg, engine, prompts, reward, tokenizer, step,
                                                producer)
            for note in rollout_m.pop("events", ()):  # first episode error of each kind
                log.event(note)
            m.update(rollout_m)
        samples = phases.broadcast(samples)
        if every_node and engine is not None and not rank0:  # this node's servers, as rank 0's
            engine.release_memory(sync.released_after_rollout(cfg))
        device_ledger.note("moment", "training")
        if offload:  # the learner back once every server released its memory
            colocated_sync.learner_back(learner)
        m["time/rollout"] = time.perf_counter() - t_step

        # 3. Reference log-probs (KL; off when kl_coef is 0), then group-relative advantages.
        #    When step 4 needs the learner's own log-probs, both come from one forward pass.
        need_lps = phases.learner_logprobs_needed(cfg, controller, samples, step)
        ref, learner_lps, kl_m = phases.reference_logprobs(cfg, learner, samples, need_lps)
        m.update(kl_m)
        m.update(phases.fill_advantages(cfg, samples))

        # 4. pi_old: the engine's log-probs, or the learner's recompute; audited on schedule.
        t_old = time.perf_counter()
        n_events = len(controller.events)
        old, source, precision_m = phases.old_logprobs(cfg, learner, controller, samples, step,
                                                       learner_lps)
        m.update(precision_m)
        m["precision/old_logprobs"] = source
        m["time/old_logprobs"] = time.perf_counter() - t_old
        for event in controller.events[n_events:]:
            log.event(f"step {step}: pi_old {event['switch']} (out-of-range share "
                      f"{event['out_of_range_fraction']:.4f}, tolerance {event['tolerance']})")

        # 5. Optimizer steps over the mini-batches of this rollout batch (MoE: the routing at
        #    the start weights is recorded first; routing metrics after the updates).
        t_train = time.perf_counter()
        m.update(phases.moe_routing_start(learner, samples))
        m.update(phases.train_on_batch(cfg, learner, samples, old, step, ref))
        m.update(phases.moe_routing_end(cfg, learner, samples, step))
        m["time/train"] = time.perf_counter() - t_train

        # 6. New weights to the rollout engine.
        t_sync = time.perf_counter()
        with producer.updating() if producer else nullcontext():  # async: pause, update, go on
            m.update(sync.sync_weights(learner, engine, hf_config, cfg, version=step + 1,
                                         event=log.event if rank0 else None))
        m["time/weight_sync"] = time.perf_counter() - t_sync

        # 7. Evaluate, log, checkpoint.
        if cfg.train.eval_interval and (step + 1) % cfg.train.eval_interval == 0:
            m.update(phases.evaluate(cfg, engine, tokenizer, reward, evals) if rank0 else {})
        m["time/step"] = time.perf_counter() - t_step
        if saves is not None:  # an earlier save whose files are written: COMPLETE
            t_poll = time.perf_counter()
            saves.poll()
            ckpt_s += time.perf_counter() - t_poll
        m["time/checkpoint"] = ckpt_s  # the loop's time in the last checkpoint and polls since
        ckpt_s = 0.0
        log.log(step, m)
        for note in ckpt.take_events() if rank0 else ():  # a checkpoint's COMPLETE is durable
            log.event(note)
        skipped = int(m.get("update_skipped", 0))
        skipped_in_a_row = skipped_in_a_row + 1 if skipped == m["optimizer_steps"] else 0
        if skipped:
            log.event(f"step {step}: {skipped} of {int(m['optimizer_steps'])} optimizer updates "
                      "skipped (non-finite loss or gradients); the weights did not take them")
        if cfg.train.max_skipped_steps and skipped_in_a_row >= cfg.train.max_skipped_steps:
            raise RunError(f"step {step}: the loss or gradients were non-finite in "
                           f"{skipped_in_a_row} steps in a row (train.max_skipped_steps); "
                           f"stopping; checkpoints under {ckpt_root} hold finite weights")
        if rank0 and cfg.logging.log_samples:
            log.event(phases.sample_preview(samples, tokenizer, cfg.logging.log_samples, step))
        done = step + 1 == cfg.train.max_steps
        if (cfg.checkpoint.interval and (step + 1) % cfg.checkpoint.interval == 0) or done:
            phases.wait_for_rank0()  # rank 0's evaluation and weight push
            state = {"step": step + 1, "precision": controller.state_dict(),
                     "data": prompts.state_dict() if rank0 else None,
                     "async": producer.state_dict() if producer else None,
                     "config": resume_checks.config_record(cfg)}  # what resume compares
            t_ckpt = time.perf_counter()
            with colocated_sync.learner_room(learner, engine, CHECKPOINT_PARTS, "checkpoint"):
                path = ckpt.save(step + 1, learner, state, queue=saves)
            if saves is not None and done:
                saves.wait()
            ckpt_s = time.perf_counter() - t_ckpt
            if saves is None:  # published; an asynchronous one says so once it is
                log.event(f"checkpoint {path} ({ckpt_s:.3f} s in the training loop)")
            for note in ckpt.take_events() if rank0 else ():
                log.event(note)

    return run_dir  # `cleanup` closes the log, the producer, the engine and the learner
