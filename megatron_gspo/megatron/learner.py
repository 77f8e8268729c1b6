"""The Megatron-Core learner: one object per rank that owns the model chunks, the optimizer and
the packing of a mini-batch, and runs GSPO / GSPO-token / GRPO optimizer steps.

Same code on CPU (gloo, with `megatron_gspo.megatron.cpu`) and GPU (NCCL). Every rank receives
the SAME global mini-batch (a list of `Sample`s; `broadcast_samples` sends rank 0's list); the
learner picks this DP rank's share with `plan_microbatches`, packs micro-batches, and runs
Megatron's pipeline schedule. Usable in-process (world size 1) or under
`torchrun --nproc_per_node=N` (`python -m megatron_gspo.megatron --help`: a smoke run on any
layout).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo.data.batch import MicroBatch, pack_microbatch, pad_microbatch, plan_microbatches
from megatron_gspo.data.sample import Sample
from megatron_gspo.megatron.lora import adapters as lora_
from megatron_gspo.megatron import mtp_loss, parallel, step
from megatron_gspo.megatron.moe import router_replay
from megatron_gspo.megatron.learner_state import LearnerState
from megatron_gspo.megatron.models import deepseek_v3
from megatron_gspo.megatron.models.builder import build_gpt_model, build_model_config
from megatron_gspo.runtime import device_ledger
from megatron_gspo.megatron.optimizer import (OptimSettings, all_ranks_agree, build_optimizer,
                                              current_lr, grads_finite, wrap_ddp)


@dataclass(frozen=True)
class BatchSettings:
    """How a mini-batch is cut: `num_microbatches` per DP rank (minimum) and/or a token budget
    per micro-batch; `pad_id` pads packed rows."""

    num_microbatches: int | None = None
    max_tokens_per_microbatch: int | None = None
    pad_id: int = 0


class Learner(LearnerState):
    """Model chunks + optimizer + scheduler of this rank.

    Args:
        hf_config: parsed Hugging Face config.json.
        layout: parallel sizes (DP derived from the world size).
        optim: optimizer / LR schedule settings.
        loss: policy-loss settings.
        batching: micro-batch settings.
        params_dtype: float32 / bfloat16 / float16.
        seed: model-init / RNG seed.
        use_te: force the TE (True) / local (False) layer spec; None = TE when importable.
        recompute: full activation recompute.
        model_kwargs: extra `build_model_config` arguments (e.g. moe_aux_loss_coeff).
        reference: also build a frozen reference policy (KL term) in the same parallel layout;
            its weights are set by `load_reference` (None = no reference parameters at all).
        reference_offload: keep the reference's weights in CPU memory between its forwards.
        offload_outside_step: fp32 main weights and Adam moments wait in host memory except
            during each optimizer step (`optimizer.offload_outside_step`).
        routing_replay: MoE routing replay, "none" | "r2" | "r3" (`megatron.moe.router_replay`);
            MoE models always record routing for the `moe/*` metrics.
        lora: LoRA adapters (`megatron.lora.adapters.LoraSettings`) on the targeted layers, every
            other weight frozen and only the adapters in the optimizer; with `reference` the KL
            reference is this model with its adapters off (no second model is built).
        mtp: also build the config's multi-token-prediction layers, outside the policy forward
            (`models.mtp_block`): frozen, or trained by their own loss when loss.mtp_weight > 0
            (`megatron.mtp_loss`); the weight sync sends them to engines with a draft only.
    """

    def __init__(self, hf_config: dict, *, layout: parallel.ParallelLayout | None = None,
                 optim: OptimSettings | None = None, loss: step.LossSettings | None = None,
                 batching: BatchSettings | None = None, params_dtype: torch.dtype = torch.float32,
                 seed: int = 1234, use_te: bool | None = None, recompute: bool = False,
                 model_kwargs: dict | None = None, reference: bool = False,
                 reference_offload: bool = False, routing_replay: str = "none",
                 offload_outside_step: bool = False,
                 lora: lora_.LoraSettings | None = None, mtp: bool = False):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.transformer.module import Float16Module

        self.hf_config = hf_config
        self.layout = layout or parallel.ParallelLayout()
        self.optim_settings = optim or OptimSettings()
        self.loss_settings = loss or step.LossSettings()
        self.batching = batching or BatchSettings()
        self.params_dtype = params_dtype
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        deepseek_v3.check_training_layout(hf_config, self.layout.tensor,
                                          self.layout.sequence_parallel)
        self.dp_size = parallel.initialize(self.layout, seed=seed, hf_config=hf_config)
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        lay = self.layout
        self.config = build_model_config(
            hf_config, params_dtype=params_dtype, tensor_parallel=lay.tensor,
            pipeline_parallel=lay.pipeline, virtual_pipeline=(
                lay.virtual_pipeline if (lay.virtual_pipeline or 1) > 1 else None),
            expert_parallel=lay.expert, expert_tensor_parallel=lay.expert_tensor,
            context_parallel=lay.context, sequence_parallel=lay.sequence_parallel,
            recompute=recompute, use_te=use_te,
            **router_replay.with_replay_enabled(hf_config, model_kwargs))
        n_chunks = max(1, lay.virtual_pipeline or 1)

        def model_chunks(device, with_mtp=mtp) -> list:  # this rank's (virtual) pipeline stages
            out = []
            for vp in range(n_chunks):
                vps = vp if n_chunks > 1 else None
                out.append(build_gpt_model(
                    hf_config, config=self.config, use_te=use_te, vp_stage=vps,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vps),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vps),
                    mtp=with_mtp,
                ).to(device))
            return out

        self.chunks = model_chunks(self.device)
        mtp_loss.make_trainable(self.chunks, self.loss_settings.mtp_weight)  # before DDP
        self.lora = lora
        if lora is not None:  # before DDP and the optimizer: they see the adapters only
            lora_.attach(self.chunks, lora, seed=seed)
        wrapped = [Float16Module(self.config, m) if params_dtype != torch.float32 else m
                   for m in self.chunks]
        self.model = wrap_ddp(wrapped, use_distributed_optimizer=(
            self.optim_settings.use_distributed_optimizer))
        self.routing = router_replay.attach(self, routing_replay)  # None: no MoE layers
        self.optimizer, self.scheduler = build_optimizer(self.model, self.optim_settings,
                                                         params_dtype)
        self.config.finalize_model_grads_func = finalize_model_grads
        if params_dtype == torch.float16:
            self.config.grad_scale_func = self.optimizer.scale_loss
        tp_rank = ps.get_tensor_model_parallel_rank()
        vocab_local = self.chunks[-1].vocab_size // lay.tensor
        self.ctx = step.ParallelContext(
            tp_group=ps.get_tensor_model_parallel_group(),
            cp_group=ps.get_context_parallel_group() if lay.context > 1 else None,
            dp_size=self.dp_size, cp_size=lay.context, cp_rank=ps.get_context_parallel_rank(),
            vocab_start=tp_rank * vocab_local, vocab_size=int(hf_config["vocab_size"]))
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.steps = 0
        # fp32 main weights and Adam moments off the accelerator during forward / backward
        # (`train_step` brings them in for the optimizer step only)
        self.offload_outside_step = offload_outside_step
        self.reference_offload = reference_offload
        self.reference_chunks = None  # frozen KL reference; None = none built
        self.reference_model = None
        self.reference_is_base = reference and lora is not None  # adapters off, same model
        if reference and lora is None:
            # the KL reference is the policy alone: no MTP layers (outside the policy forward)
            self.reference_chunks = model_chunks("cpu" if reference_offload else self.device,
                                                 with_mtp=False)
            for m in self.reference_chunks:
                m.requires_grad_(False)
                m.eval()
            self.reference_model = [Float16Module(self.config, m) if params_dtype != torch.float32
                                    else m for m in self.reference_chunks]

    # ----------------------------------------------------------------------------- packing
    def _micro_batches(self, samples: list[Sample], old_logprobs,
                       needs=("weights", "grads", "reference")) -> list[MicroBatch]:
        """Packed micro-batches; `needs`: the learner parts the pass reads (main weights and
        moments wait for the optimizer step, a forward-only pass reads no gradients)."""
        from megatron.core import parallel_state as ps

        self._require_resident(needs)
        min_mbs = self.batching.num_microbatches or 1
        if len(self.model) > 1:  # the interleaved schedule needs >= PP micro-batches
            min_mbs = max(min_mbs, self.layout.pipeline)
        plan = plan_microbatches([len(s.prompt_ids) + len(s.response_ids) for s in samples],
                                 self.dp_size, num_microbatches=min_mbs,
                                 max_tokens=self.batching.max_tokens_per_microbatch)
        cp = self.layout.context
        seq_mult = 2 * cp if cp > 1 else 1
        total_mult = seq_mult * (self.layout.tensor if self.config.sequence_parallel else 1)
        mine = plan[ps.get_data_parallel_rank(with_context_parallel=False)]
        mbs = [pack_microbatch(samples, idx, old_logprobs=old_logprobs, seq_multiple=seq_mult,
                               total_multiple=total_mult, pad_id=self.batching.pad_id)
               for idx in mine]
        if self.layout.pipeline > 1:
            # Pipeline stages exchange fixed-shape activations: one row length per step,
            # the same on every DP rank.
            longest = torch.tensor([max(mb.seq_len for mb in mbs)], device=self.device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)
            mbs = [pad_microbatch(mb, int(longest), self.batching.pad_id) for mb in mbs]
        return mbs

    def _run(self, forward_step_func, data: list[dict], forward_only: bool, model=None,
             micro_batch_size: int = 1):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        model = self.model if model is None else model
        iters = [iter(data) for _ in model] if len(model) > 1 else iter(data)
        seq = max(int(d["seq_len"]) for d in data)  # full row (schedules divide by cp / tp)
        return get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=iters,
            model=model if len(model) > 1 else model[0],
            num_microbatches=len(data), seq_length=seq, micro_batch_size=micro_batch_size,
            forward_only=forward_only)

    def _routed_run(self, fstep, data: list[dict], forward_only: bool, samples: list[Sample],
                    mbs: list[MicroBatch], *, training: bool):
        """`_run` of the policy with MoE routing recorded, and replayed under r3 (every
        policy forward) or r2 (training forwards)."""
        if self.routing is None:
            return self._run(fstep, data, forward_only)
        from megatron.core import parallel_state as ps

        mode = self.routing.mode
        self.routing.begin(samples, mbs, data, version=self.steps, training=training,
                           replay=mode == "r3" or (mode == "r2" and training),
                           tp_rank=ps.get_tensor_model_parallel_rank(),
                           tp_size=self.layout.tensor, cp_rank=self.ctx.cp_rank,
                           cp_size=self.layout.context)
        try:
            out = self._run(self.routing.wrap(fstep), data, forward_only)
        except BaseException:
            self.routing.end(keep=False)
            raise
        self.routing.end()
        return out

    # ----------------------------------------------------------------------------- API
    @torch.no_grad()
    def forward_logprobs(self, samples: list[Sample], *, temperature: float | None = None,
                         with_entropy: bool = False, reference: bool = False):
        """Token log-probs of every sample's response under the current weights.

        Args:
            samples: the global mini-batch (same list on every rank).
            temperature: sampling temperature (default: the loss settings').
            with_entropy: also return per-token entropies.
            reference: use the frozen reference policy instead of the current weights.
        Returns:
            list (one per sample) of response log-prob lists [, list of entropy lists];
            identical on every rank.
        """
        temp = self.loss_settings.temperature if temperature is None else temperature
        base = reference and self.reference_is_base  # the policy with its adapters off
        if reference and self.reference_model is None and not base:
            raise ValueError("no reference model was built (kl_coef is 0)")
        model = self.reference_model if reference and not base else self.model
        mbs = self._micro_batches(samples, None, ("reference",) if reference and not base
                                  else ("weights",))
        data = [step.device_batch(mb, self.device, self.ctx) for mb in mbs]
        off = lora_.adapters_off(self.chunks) if base else contextlib.nullcontext()
        with self._forward_only(policy=not reference or base,
                                reference=reference and not base), off:
            fstep = step.logprob_forward_step_factory(self.ctx, temp, with_entropy)
            out = (self._run(fstep, data, True, model) if reference else
                   self._routed_run(fstep, data, True, samples, mbs, training=False))
        if not with_entropy:
            return self._per_sample(samples, mbs, out, ("logprobs",))[0]
        return tuple(self._per_sample(samples, mbs, out, ("logprobs", "entropy")))

    @torch.no_grad()
    def forward_logprobs_with_reference(self, samples: list[Sample], *,
                                        temperature: float | None = None):
        """The policy's and the frozen reference's token log-probs from ONE pipeline schedule
        (each micro-batch runs both models back to back, see `megatron.paired`); equal to
        `forward_logprobs(samples)` and `forward_logprobs(samples, reference=True)`, which MoE
        models with routing records run instead.

        Args:
            samples: the global mini-batch (same list on every rank).
            temperature: sampling temperature (default: the loss settings').
        Returns:
            (policy log-prob lists, reference log-prob lists), one per sample, on every rank.
        """
        from megatron_gspo.megatron.paired import (paired_chunks,
                                                   paired_logprob_forward_step_factory)

        temp = self.loss_settings.temperature if temperature is None else temperature
        if self.reference_model is None and not self.reference_is_base:
            raise ValueError("no reference model was built (kl_coef is 0)")
        if getattr(self, "routing", None) is not None or self.reference_is_base:
            # (LoRA: the reference is the same model with its adapters off, a second pass)
            # MoE routing is recorded / replayed around the policy's own schedule
            # (`megatron.moe.router_replay`), so MoE models keep the two passes
            return (self.forward_logprobs(samples, temperature=temp),
                    self.forward_logprobs(samples, temperature=temp, reference=True))
        mbs = self._micro_batches(samples, None, ("weights", "reference"))
        data = [step.device_batch(mb, self.device, self.ctx) for mb in mbs]
        with self._forward_only(policy=True, reference=True):
            out = self._run(paired_logprob_forward_step_factory(self.ctx, temp), data, True,
                            paired_chunks(self.model, self.reference_model), micro_batch_size=2)
        lps, ref = self._per_sample(samples, mbs, out, ("logprobs", "ref_logprobs"))
        return lps, ref

    @contextlib.contextmanager
    def _forward_only(self, *, policy: bool, reference: bool):
        """Policy in eval mode (train mode after); an offloaded reference on the device."""
        if reference and self.reference_offload:
            for m in self.reference_chunks:
                m.to(self.device)
        for m in (self.model if policy else []) + (self.reference_model if reference else []):
            m.eval()
        try:
            yield
        finally:
            for m in (self.model if policy else []):
                m.train()
            if reference and self.reference_offload:
                for m in self.reference_chunks:
                    m.to("cpu")

    def _per_sample(self, samples: list[Sample], mbs: list[MicroBatch], out: list,
                    keys: tuple[str, ...]) -> list[list[list[float]]]:
        """Cut each per-micro-batch [S] result in `keys` into per-sample response lists (from
        the last stage's first TP / CP rank, summed onto every rank)."""
        from megatron.core import parallel_state as ps

        width = max(len(s.response_ids) for s in samples)
        buf = torch.zeros(len(keys), len(samples), width, dtype=torch.float64,
                          device=self.device)  # [K, B, T]
        contribute = (self.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
                      and ps.get_context_parallel_rank() == 0)
        if contribute:
            for mb, res in zip(mbs, out, strict=True):
                for i, k in enumerate(mb.sample_indices):
                    s = samples[k]
                    start = int(mb.seq_index[i, 0]) + len(s.prompt_ids) - 1
                    r = len(s.response_ids)
                    for j, key in enumerate(keys):
                        buf[j, k, :r] = res[key][start:start + r].double()
        dist.all_reduce(buf)
        return [[buf[j, k, :len(s.response_ids)].tolist() for k, s in enumerate(samples)]
                for j in range(len(keys))]

    def forward_backward(self, samples: list[Sample], old_logprobs=None,
                         ref_logprobs=None) -> dict[str, float]:
        """Zero the gradients, run forward + backward over the mini-batch (gradients reduced
        over DP, ready for the optimizer) and return loss metrics.

        Args:
            samples: the global mini-batch (same list on every rank), advantages filled in.
            old_logprobs: per-sample pi_old response log-probs; None = `rollout_logprobs`.
            ref_logprobs: per-sample reference response log-probs (needed when kl_coef > 0).
        """
        if not samples:
            raise ValueError("train batch is empty")
        missing = [s.index for s in samples if s.advantage is None]
        if missing:
            raise ValueError(f"samples {missing[:5]} have no advantage")
        if old_logprobs is None:
            bad = [s.index for s in samples if s.rollout_logprobs is None]
            if bad:
                raise ValueError(f"samples {bad[:5]} have no rollout_logprobs and no "
                                 "old_logprobs were given")
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        mbs = self._micro_batches(samples, old_logprobs)
        n_seq = float(sum(1 for s in samples if s.num_trainable > 0))
        n_tok = float(sum(s.num_trainable for s in samples))
        data = [step.device_batch(mb, self.device, self.ctx) for mb in mbs]
        if self.loss_settings.kl_coef > 0:
            if ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs the reference log-probs of the batch")
            # same plan and packing as `mbs`: the reference values land on the same positions
            for d, rmb in zip(data, self._micro_batches(samples, ref_logprobs), strict=True):
                d["ref_logprobs"] = rmb.old_logprobs.to(self.device).reshape(-1)  # [S]
        fstep = step.forward_step_factory(self.loss_settings, self.ctx,
                                          num_sequences=max(n_seq, 1.0),
                                          num_tokens=max(n_tok, 1.0),
                                          num_microbatches=len(data))
        out = self._routed_run(fstep, data, False, samples, mbs, training=True)
        return self._metrics(out, len(data), sum(mb.seq_len for mb in mbs))

    def _metrics(self, out: list, n_mb: int, local_tokens: int) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        keys = None
        vec = None
        if self.is_last_stage:
            m = step.reduce_metrics(out, ps.get_data_parallel_group(with_context_parallel=False),
                                    self.device)
            keys = sorted(m)
            vec = torch.tensor([m[k] for k in keys], dtype=torch.float64, device=self.device)
        # send the last stage's metrics to every pipeline stage
        obj = [keys]
        pp_group = ps.get_pipeline_model_parallel_group()
        last = ps.get_pipeline_model_parallel_last_rank()
        if self.layout.pipeline > 1:
            dist.broadcast_object_list(obj, src=last, group=pp_group)
            keys = obj[0]
            if vec is None:
                vec = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
            dist.broadcast(vec, src=last, group=pp_group)
        res = dict(zip(keys, vec.tolist(), strict=True))
        res["micro_batches"] = float(n_mb)
        res["packed_tokens"] = float(local_tokens)
        return res

    def optimizer_step(self, loss_finite: bool = True) -> dict[str, float]:
        """One optimizer + LR-scheduler step on the accumulated gradients; skipped on every rank
        (`update_skipped` 1, weights, optimizer state and schedule untouched) when the loss or
        any rank's gradients are non-finite."""
        lr = current_lr(self.optimizer)
        self.onload(["main", "moments"] if self.offload_outside_step else [])
        self._require_resident()
        if not all_ranks_agree(loss_finite and grads_finite(self.model), self.device):
            for m in self.model:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            return {"grad_norm": float("nan"), "lr": lr, "update_skipped": 1.0}
        ok, grad_norm, _ = self.optimizer.step()
        self.note_memory()  # Adam's moments exist from the first step on
        if ok:
            self.scheduler.step(increment=1)
            self.steps += 1
        return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "lr": lr, "update_skipped": float(not ok)}

    def train_step(self, samples: list[Sample], old_logprobs=None,
                   ref_logprobs=None) -> dict[str, float]:
        """One optimizer step over a global mini-batch.

        Returns:
            metrics: loss, clip_fraction(_low/_high), ratio_mean/min/max, entropy, grad_norm,
            lr, trainable_tokens, sequences, micro_batches, time_fwd_bwd, time_optimizer,
            tokens_per_s (all ranks' packed tokens / step time).
        """
        t0 = time.perf_counter()
        if self.offload_outside_step:  # main weights + moments in host memory until the step
            self.offload(("main", "moments"))
        with device_ledger.transient("activations", "logits / log-probs"):
            metrics = self.forward_backward(samples, old_logprobs, ref_logprobs)
        t1 = time.perf_counter()
        metrics.update(self.optimizer_step(math.isfinite(metrics["loss"])))
        t2 = time.perf_counter()
        tokens = float(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples))
        metrics.update(time_fwd_bwd=t1 - t0, time_optimizer=t2 - t1,
                       tokens=tokens, tokens_per_s=tokens / max(t2 - t0, 1e-9))
        return metrics

    def shutdown(self) -> None:
        """Release the process groups."""
        parallel.shutdown()


def broadcast_samples(samples: list[Sample] | None, src: int = 0) -> list[Sample]:
    """Send rank `src`'s sample list to every rank (pickled object broadcast)."""
    obj = [samples]
    if dist.is_initialized() and dist.get_world_size() > 1:  # waits for rank 0's rollout: gloo
        dist.broadcast_object_list(obj, src=src, group=parallel.rank0_group())
    return obj[0]
