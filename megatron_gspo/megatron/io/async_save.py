"""Asynchronous checkpoints with Megatron-Core's dist-checkpointing (`async_sharded_save` and
`AsyncCallsQueue`, megatron/core/dist_checkpointing/strategies/async_utils.py, 0.16.1-0.19).

`Checkpointer.save(..., queue=AsyncSaves())` stages the learner's tensors (a device-to-host
copy on GPU), forks a writer per rank and returns; training goes on. `poll()` after every step
(collective: one integer all-reduce) finalizes a save whose writers ended on every rank:
Megatron's metadata, then the rename and the COMPLETE marker (`Checkpointer._publish`); the
writer fsyncs every file it wrote before it ends. So COMPLETE never names files that are not
durable, and a rank killed during the save leaves only the `.tmp_step_*` folder (removed at the
next start). One save is in flight at a time: the next `schedule` waits for the previous one.
The loop state (`trainer.json`, RNG) is written when the save is scheduled, from the same step
as the staged tensors. From 0.17 Megatron-Core marks its own writer deprecated in favour of
nvidia-resiliency-ext: `compat.async_save_kwargs()` picks NVRx where it is installed, and its
queue is taken then (checked here only with Megatron-Core's writer, 0.16.1 and 0.19.2).
"""

from __future__ import annotations

__all__ = ["AsyncSaves"]


class AsyncSaves:
    """The queue of asynchronous checkpoint saves of one run (every rank holds one)."""

    def __init__(self):
        from megatron_gspo.megatron import compat

        if compat.async_save_kwargs().get("async_strategy") == "nvrx":  # 0.17+ with NVRx
            from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        else:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        self.queue = AsyncCallsQueue(persistent=False)

    def schedule(self, request, finalize) -> None:
        """Schedule Megatron's `request` (collective); `finalize` runs once it is done on all
        ranks, after Megatron's own finalize functions."""
        self.wait()  # one save in flight
        request.add_finalize_fn(finalize)
        self.queue.schedule_async_request(request)

    def poll(self) -> int:
        """Finalize the saves that ended on every rank (collective); the number finalized."""
        return len(self.queue.maybe_finalize_async_calls(blocking=False))

    def wait(self) -> int:
        """Wait for every scheduled save and finalize it (collective)."""
        return len(self.queue.maybe_finalize_async_calls(blocking=True))

    def pending(self) -> int:
        return self.queue.get_num_unfinalized_calls()

    def close(self) -> None:
        """Stop the writers without finalizing (an ended run: its save stays partial)."""
        self.queue.close(abort=True)
