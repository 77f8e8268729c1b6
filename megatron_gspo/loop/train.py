"""The GSPO RL loop (arXiv 2507.18071), readable top to bottom:

    sample prompts -> rollout (groups of G) -> rewards -> group advantages -> pi_old (engine
    log-probs or learner recompute, audited) -> optimizer steps over mini-batches -> weight sync
    -> log / eval / checkpoint

Every rank runs this loop. Rank 0 owns the prompts, the rollout engine and the rewards; the
samples are broadcast so every rank trains on the same global batch (the learner picks its
data-parallel share). Helpers live where they belong: `loop/startup.py` (the start-up phase:
learner, weights, engine, log, first sync), `loop/build.py` (objects from the config),
`loop/server_setup.py` (SGLang servers), `loop/phases.py` (each phase of a step),
`runtime/run_checkpoint.py`, `runtime/metrics.py`, `algo/` (the math).
"""

from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

from megatron_gspo.loop import build, early_checks, phases, resume_checks, startup
from megatron_gspo.loop import weight_sync_phase as sync
from megatron_gspo.config import Config
from megatron_gspo.megatron.learner_state import CHECKPOINT_PARTS
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
    # 0. Start-up: inputs checked, learner and its weights, engine, log, first weight sync.
    r = startup.start_run(cfg, run_dir, ckpt_root, lock, cleanup, restart_note)
    rank0, learner, engine, log, ckpt = r.rank0, r.learner, r.engine, r.log, r.ckpt
    prompts, reward, tokenizer, producer, controller = (r.prompts, r.reward, r.tokenizer,
                                                        r.producer, r.controller)
    ckpt_s = 0.0  # seconds the loop spent in checkpoint work since the last metrics row
    skipped_in_a_row = 0  # steps whose optimizer updates were all skipped (non-finite)

    for step in range(r.start, cfg.train.max_steps):
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
        if r.every_node and engine is not None and not rank0:  # this node's servers, as rank 0's
            engine.release_memory(sync.released_after_rollout(cfg))
        device_ledger.note("moment", "training")
        if r.offload:  # the learner back once every server released its memory
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
            m.update(sync.sync_weights(learner, engine, r.hf_config, cfg, version=step + 1,
                                       event=log.event if rank0 else None))
        m["time/weight_sync"] = time.perf_counter() - t_sync

        # 7. Evaluate, log, checkpoint.
        if cfg.train.eval_interval and (step + 1) % cfg.train.eval_interval == 0:
            m.update(phases.evaluate(cfg, engine, tokenizer, reward, r.evals) if rank0 else {})
        m["time/step"] = time.perf_counter() - t_step
        if r.saves is not None:  # an earlier save whose files are written: COMPLETE
            t_poll = time.perf_counter()
            r.saves.poll()
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
                path = ckpt.save(step + 1, learner, state, queue=r.saves)
            if r.saves is not None and done:
                r.saves.wait()
            ckpt_s = time.perf_counter() - t_ckpt
            if r.saves is None:  # published; an asynchronous one says so once it is
                log.event(f"checkpoint {path} ({ckpt_s:.3f} s in the training loop)")
            for note in ckpt.take_events() if rank0 else ():
                log.event(note)

    return run_dir  # `cleanup` closes the log, the producer, the engine and the learner
