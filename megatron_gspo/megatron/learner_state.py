"""The learner's weights, frozen reference and checkpoints (a base class of `Learner`).

Full (TP=PP=EP=1) state dicts in and out of the model chunks, the KL reference's weights, and
Megatron-Core `dist_checkpointing` (torch_dist) save/load of model, optimizer and scheduler in
any parallel layout, with the model-parallel RNG tracker's state. Attributes used (set by
`Learner.__init__`): chunks, model, reference_chunks, reference_offload, tied, optimizer,
optim_settings, scheduler, steps, hf_config, params_dtype.

`offload` / `onload` move the weights, gradient buffer, main weights, Adam moments and KL
reference off the accelerator and back (`megatron.memory.offload`: storages released, views kept).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.megatron.models import shards as weights


CHECKPOINT_PARTS = ("weights", "main", "moments")  # what `save_checkpoint` reads


class LearnerState:
    """Weights, reference and checkpoint methods of `Learner`."""

    # ----------------------------------------------------------------------------- weights
    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Set all weights from a full (TP=PP=EP=1) Megatron-named state dict; refreshes the
        optimizer's fp32 main parameters."""
        weights.load_full_state_dict(self.chunks, full, self.tied)
        self._refresh_main_params()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights gathered from all ranks (on every rank; small models / tests)."""
        return weights.gather_full(self.chunks, self.tied)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients after `forward_backward` (needs the non-distributed optimizer)."""
        if self.optim_settings.use_distributed_optimizer:
            raise ValueError("full_grads needs use_distributed_optimizer=False (gradients are "
                             "reduce-scattered otherwise)")
        return weights.gather_full(self.chunks, self.tied, grads=True)

    def load_reference(self, full: dict[str, torch.Tensor] | None = None) -> None:
        """Set the frozen reference's weights: from a full (TP=PP=1) Megatron-named state dict,
        or (None) a copy of the current policy weights."""
        if self.reference_chunks is None:
            raise ValueError("no reference model was built (kl_coef is 0)")
        with torch.no_grad():
            if full is None:
                for src, dst in zip(self.chunks, self.reference_chunks, strict=True):
                    dst.load_state_dict(src.state_dict())
            else:
                weights.load_full_state_dict(self.reference_chunks, full, self.tied)

    def reference_bytes(self) -> int:
        """Bytes of this rank's reference parameters (0 when none is built)."""
        if self.reference_chunks is None:
            return 0
        return sum(p.numel() * p.element_size() for m in self.reference_chunks
                   for p in m.parameters())

    def _refresh_main_params(self) -> None:
        opt = self.optimizer
        for o in getattr(opt, "chained_optimizers", [opt]):
            if hasattr(o, "reload_model_params"):
                o.reload_model_params()

    # ----------------------------------------------------------------------------- offload
    def _offloader(self):
        from megatron_gspo.megatron.memory.offload import StorageOffload

        if getattr(self, "_offload", None) is None:
            self._offload = StorageOffload()
        return self._offload

    def offloaded_parts(self) -> list[str]:
        """Parts now off the accelerator (see `offload`)."""
        from megatron_gspo.megatron.memory.offload import PARTS

        off = getattr(self, "_offload", None)
        return [p for p in PARTS if off is not None and off.offloaded(p)]

    def offload(self, parts=("weights", "grads", "main", "moments", "reference")) -> int:
        """Release the accelerator memory of `parts` of this rank (weights, grads, main,
        moments, reference); gradients are dropped (zeros when they come back), the others
        copied to (pinned) host memory first. Returns the bytes released."""
        from megatron_gspo.megatron.memory import offload as off

        o = self._offloader()
        weights = [p for m in self.chunks for p in m.parameters()]
        wptrs = {p.untyped_storage().data_ptr() for p in weights}
        main, state = off.optimizer_tensors(self.optimizer)
        ref = [p for m in (self.reference_chunks or []) for p in m.parameters()] \
            if not getattr(self, "reference_offload", False) else []
        groups = {"weights": (weights, True), "grads": (off.grad_buffers(self.model), False),
                  "main": (main, True), "moments": (state, True), "reference": (ref, True)}
        total = 0
        for part in parts:
            tensors, keep = groups[part]
            total += o.offload(part, tensors, keep=keep, skip=wptrs if part != "weights" else None)
        self.note_memory()
        return total

    def note_memory(self) -> None:
        """Tell the device-memory ledger (`runtime.device_ledger`, when one is installed) which of
        this rank's parts are on the device now (Adam moments exist after the first step or a
        checkpoint load; the KL reference when one is built and kept on the device)."""
        from megatron_gspo.runtime import device_ledger

        if not device_ledger.active():
            return
        from megatron_gspo.megatron.memory.offload import optimizer_tensors

        away = set(self.offloaded_parts())
        exists = {"weights": True, "grads": True, "main": True,
                  "moments": bool(optimizer_tensors(self.optimizer)[1]),
                  "reference": bool(getattr(self, "reference_chunks", None))
                  and not getattr(self, "reference_offload", False)}
        device_ledger.note("set_learner", {p: e and p not in away for p, e in exists.items()})

    def offloaded_bytes(self) -> int:
        """Bytes of this rank's accelerator memory now released by `offload`."""
        off = getattr(self, "_offload", None)
        return sum(n for recs in (off.parts.values() if off else []) for _, n, _ in recs)

    def onload(self, parts=None) -> int:
        """Bring offloaded `parts` (default: all) back; returns the bytes restored."""
        o = self._offloader()
        n = sum(o.onload(p) for p in (self.offloaded_parts() if parts is None else parts))
        self.note_memory()
        return n

    def _require_resident(self, parts=None) -> None:
        off = [p for p in self.offloaded_parts() if parts is None or p in parts]
        if off:
            raise RuntimeError(f"learner {', '.join(off)} offloaded: call onload() first")

    # ----------------------------------------------------------------------------- checkpoints
    def sharded_state_dict(self) -> dict:
        """Model + optimizer + scheduler state for `megatron.core.dist_checkpointing`."""
        from megatron_gspo.megatron.io.dist_checkpoint import moe_norm_keys_as_te

        if getattr(self, "lora", None) is not None:  # adapters only; the base stays where it is
            from megatron_gspo.megatron.lora import adapters as lora

            return {"lora": lora.sharded_state_dict(self.chunks)}
        sd = {}
        for i, m in enumerate(self.chunks):  # unwrapped GPTModels: no DDP "module." prefix
            key = f"model{i}" if len(self.chunks) > 1 else "model"
            sd[key] = m.sharded_state_dict()
            moe_norm_keys_as_te(sd[key], m)  # MoE checkpoints load under either layer spec
        return sd

    def _full_sharded_sd(self, is_loading: bool) -> dict:
        sd = self.sharded_state_dict()
        meta = {"distrib_optim_sharding_type": "dp_reshardable"}
        if is_loading and self.optim_settings.use_distributed_optimizer:
            for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if hasattr(o, "_init_optimizer_states_with_dummy_values"):
                    o._init_optimizer_states_with_dummy_values()
        sd["optimizer"] = self.optimizer.sharded_state_dict(sd, is_loading=is_loading,
                                                            metadata=meta)
        sd["scheduler"] = self.scheduler.state_dict()
        sd["steps"] = self.steps
        sd["adam_step"] = None if is_loading else self._adam_step()
        return sd

    def _adam_step(self) -> float | None:
        """Adam's step count (bias correction); None before the first step. Per parameter
        (torch's AdamW) or per param group (TE's FusedAdam): `megatron.adam_step`."""
        from megatron_gspo.megatron import adam_step

        return adam_step.read(self.optimizer)

    def _restore_adam_step(self, step: float) -> None:
        """Put a saved step count back wherever the optimizer keeps it."""
        from megatron_gspo.megatron import adam_step

        adam_step.restore(self.optimizer, step)

    def save_checkpoint(self, path: str, schedule=None, save_kwargs=None, stage=None) -> None:
        """Save model, optimizer and scheduler (torch_dist format) to directory `path`.

        Args:
            schedule: asynchronous save: called with Megatron-Core's AsyncRequest, which it
                schedules (the tensors are staged then, before offloaded parts leave again);
                the files are written by a forked writer. None: written before returning.
            save_kwargs: more `dist_checkpointing.save` arguments (an asynchronous run's
                strategy with its cached structure: `io.async_save.AsyncSaves.save_kwargs`).
            stage: applied to the sharded state dict before the save (`AsyncSaves.stage`).
        """
        import os

        from megatron.core import dist_checkpointing

        from megatron_gspo.megatron.io.child_procs import (install_checkpoint_results_queue,
                                                        tie_forked_children)

        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        # saved from resident tensors, offloaded again after; the gradient buffer and the KL
        # reference are not saved, so they stay where they are
        away = [p for p in self.offloaded_parts() if p in CHECKPOINT_PARTS]
        self.onload(away)
        dist.barrier()
        install_checkpoint_results_queue()  # its server dies with this process
        tie_forked_children()  # and so do the writer processes Megatron forks
        from megatron_gspo.megatron import compat

        kwargs = compat.async_save_kwargs() if schedule is not None else {}
        sharded = self._full_sharded_sd(False)
        request = dist_checkpointing.save(
            stage(sharded) if stage else sharded, path, async_sharded_save=schedule is not None,
            **{**kwargs, **(save_kwargs or {})})
        if dist.get_rank() == 0:  # the config `convert mcore-to-hf` rebuilds and checks with
            from megatron_gspo.convert.sources import write_model_info

            write_model_info(path, self.hf_config, str(self.params_dtype).removeprefix("torch."),
                             getattr(self, "model_source", None))
            if getattr(self, "lora", None) is not None:
                from megatron_gspo.megatron.lora.io import write_adapter_info

                write_adapter_info(path, self.lora, getattr(self, "lora_base", None))
        if schedule is not None:
            schedule(request)
        self.offload(away)

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint written by `save_checkpoint` (any parallel layout).

        Trust: Megatron's torch_dist format reads its `.metadata` with `pickle.load`; load only
        checkpoints from sources you trust.
        """
        from megatron.core import dist_checkpointing

        self._require_resident()
        if getattr(self, "lora", None) is not None:
            from megatron_gspo.megatron.lora.io import check_adapter_info

            check_adapter_info(path, self.lora)  # one line naming a mismatch
        sd = self._full_sharded_sd(True)
        with torch.no_grad():
            loaded = dist_checkpointing.load(sd, path)
        if "lora" in loaded:  # adapters only (the base weights were loaded before)
            from megatron_gspo.megatron.lora import adapters as lora

            lora.load_sharded(self.chunks, loaded["lora"])
        for i, m in enumerate(self.chunks if "lora" not in loaded else []):
            key = f"model{i}" if len(self.chunks) > 1 else "model"
            m.load_state_dict(loaded[key])
        # No main-weight refresh from the bf16 weights here: `dist_checkpointing.load` has
        # already filled the optimizer's fp32 main weights in place from the checkpoint, and a
        # refresh would round them to bf16 (a resumed run would then drift from the original).
        self.optimizer.load_state_dict(loaded["optimizer"])
        if loaded.get("adam_step") is not None:
            # the distributed optimizer's reshardable format restores its dummy step (1)
            self._restore_adam_step(loaded["adam_step"])
        self.scheduler.load_state_dict(loaded["scheduler"])
        self.steps = int(loaded["steps"])

    def rng_state(self) -> dict:
        """States of Megatron's model-parallel RNG tracker (dropout etc.) on this rank."""
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker().get_states()

    def load_rng_state(self, state: dict) -> None:
        """Restore what `rng_state` returned."""
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state)
