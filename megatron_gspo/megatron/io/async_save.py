"""Asynchronous checkpoints with Megatron-Core's dist-checkpointing (`async_sharded_save` and
`AsyncCallsQueue`, megatron/core/dist_checkpointing/strategies/async_utils.py, 0.16.1-0.19).

`Checkpointer.save(..., queue=AsyncSaves())` stages the learner's tensors (a device-to-host
copy on GPU, Megatron's clone of buffer views on CPU), forks a writer per rank and returns;
training goes on. `poll()` after every step (collective: one integer all-reduce) finalizes a
save whose writers ended on every rank: Megatron's metadata (write-result gather, `.metadata`,
`metadata.json`), then, in a thread of this process, our publish (`Checkpointer._publish`:
fsync of every file, sha256 manifest, rename, COMPLETE). The writer fsyncs every file it wrote
before it ends. So COMPLETE never names files that are not durable, and a rank killed during
the save leaves only the `.tmp_step_*` folder (removed at the next start). One save is in
flight at a time: the next `schedule` waits for the previous one, publish included. The loop
state (`trainer.json`, RNG) is written when the save is scheduled, from the same step as the
staged tensors.

What makes a save cheap for the training loop (bench/checkpoint_profile.py measures each part):
- the writer's results queue (a spawned multiprocessing Manager) is started with the run, not
  in the first save (seconds on a loaded machine);
- one save strategy for the run with Megatron's cached save structure (`cached_metadata`, the
  `--ckpt-assume-constant-structure` of Megatron-LM): from the third save the local and global
  plans are reused and the metadata gather is skipped; the access-integrity check (an
  all-gather of every shard's metadata) runs on the first save only: the model, the optimizer
  and the layout do not change during a run;
- CPU tensors that are views of a larger buffer (Megatron's parameter buffer) are copied into
  staging buffers kept for the run (`stage`): Megatron would clone them into fresh memory on
  every save, and on this kind of VM the page faults of fresh memory, not the copy, cost
  (0.26 s per save of the tiny demo on loaded cores); NVRx keeps pinned staging buffers on GPU
  for the same reason;
- one writer process per rank (`thread_count=1`; 0.16.1 defaults to 2: two forks per save);
- hashing the files (seconds for a 2 GB checkpoint) runs beside training, not in the poll;
- the writer processes and the publish thread run at the lowest CPU priority (nice 19): where
  training keeps every core busy (CPU training) they take its gaps instead of slowing it.
The writer is forked per save (Megatron's `TemporalAsyncCaller`), not a persistent spawned
worker: on CPU Megatron stages only views (`preload_tensors` is a no-op for CPU tensors), so a
persistent worker would write optimizer states that training already changed; the fork's
copy-on-write memory is the snapshot. From 0.17 Megatron-Core marks its own writer deprecated
in favour of nvidia-resiliency-ext: `compat.async_save_kwargs()` picks NVRx where megatron-core
finds it usable (nvidia-resiliency-ext >= 0.6.0, which the registry does not serve: every release
it serves, 0.1.3 to 0.4.1, leaves Megatron-Core's writer in use, tests/megatron/
test_async_save_nvrx.py), and the queue is the one upstream pairs with that writer.
"""

from __future__ import annotations

import threading

import torch

from megatron_gspo.megatron.io.child_procs import (background_children,
                                                   install_checkpoint_results_queue,
                                                   lower_priority, tie_forked_children)

__all__ = ["AsyncSaves"]


class AsyncSaves:
    """The queue of asynchronous checkpoint saves of one run (every rank holds one)."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.torch import (
            TorchDistSaveShardedStrategy,
        )

        from megatron_gspo.megatron import compat

        self.kwargs = compat.async_save_kwargs()
        self.queue = compat.async_calls_queue(self.kwargs)(persistent=False)
        self.strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1,
                                                     cached_metadata=True)
        self.saves = 0
        self._staging: dict[tuple, torch.Tensor] = {}  # (key, offset, range) -> buffer
        self._publisher: threading.Thread | None = None
        self._error: BaseException | None = None
        self.on_error = None  # set by the Checkpointer: an error -> the one to raise
        install_checkpoint_results_queue()  # at start-up: its server dies with this process
        tie_forked_children()  # and so do the writer processes Megatron forks

    def save_kwargs(self) -> dict:
        """Keyword arguments of this run's next `dist_checkpointing.save` (async)."""
        first = self.saves == 0
        self.saves += 1
        return {**self.kwargs, "sharded_strategy": self.strategy,
                "validate_access_integrity": first}

    def stage(self, sharded_sd: dict) -> dict:
        """`sharded_sd` (in place) with each CPU tensor that is a view of a larger storage
        copied into this run's staging buffer for it (reused from save to save); factories
        are applied first, so their views are staged too. GPU tensors are left to Megatron's
        device-to-host preload."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

        apply_factories(sharded_sd)

        def visit(x):
            t = getattr(x, "data", None) if isinstance(x, ShardedTensor) else None
            if t is None or t.device.type != "cpu" or \
                    t.untyped_storage().size() == t.numel() * t.itemsize:
                return x
            r = x.flattened_range
            key = (x.key, tuple(x.global_offset), None if r is None else (r.start, r.stop))
            buf = self._staging.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._staging[key] = torch.empty(t.shape, dtype=t.dtype)
            buf.copy_(t.detach())
            x.data = buf
            return x

        dict_list_map_inplace(visit, sharded_sd)
        return sharded_sd

    def schedule(self, request, finalize) -> None:
        """Schedule Megatron's `request` (collective); `finalize` runs once it is done on all
        ranks, after Megatron's own finalize functions."""
        self.wait()  # one save in flight
        request.add_finalize_fn(finalize)
        with background_children():  # the forked writer yields the cores to training
            self.queue.schedule_async_request(request)

    def in_background(self, publish) -> None:
        """Run `publish` (rank-local file work: fsync, hashes, rename, COMPLETE) in a thread;
        `poll`, `wait` and the next `schedule` raise what it raised."""
        def run() -> None:
            lower_priority()  # this thread only (Linux): hashing yields to training
            try:
                publish()
            except BaseException as e:  # noqa: BLE001 - re-raised in the loop's thread
                self._error = e

        self._publisher = threading.Thread(target=run, name="checkpoint-publish", daemon=True)
        self._publisher.start()

    def _check(self, block: bool) -> None:
        if self._publisher is not None and (block or not self._publisher.is_alive()):
            self._publisher.join()
            self._publisher = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _finalize(self, blocking: bool) -> int:
        """Finalize (and with `blocking` wait for) the scheduled saves and their publish; what
        a writer or the publish raised goes through `on_error` (a full disk: one line)."""
        try:
            if not blocking:
                self._check(block=False)
            n = len(self.queue.maybe_finalize_async_calls(blocking=blocking))
            if blocking:
                self._check(block=True)
            return n
        except BaseException as e:
            err = self.on_error(e) if self.on_error is not None else e
            if err is e:
                raise
            raise err from None

    def poll(self) -> int:
        """Finalize the saves that ended on every rank (collective); the number finalized."""
        return self._finalize(blocking=False)

    def wait(self) -> int:
        """Wait for every scheduled save, finalize and publish it (collective)."""
        return self._finalize(blocking=True)

    def pending(self) -> int:
        return self.queue.get_num_unfinalized_calls() + (self._publisher is not None)

    def close(self) -> None:
        """Stop the writers without finalizing (an ended run: its save stays partial); a
        finalized save's publish ends first."""
        from megatron_gspo.megatron import compat

        if self._publisher is not None:
            self._publisher.join()
        compat.close_async_queue(self.queue)
