"""The embedded rollout engine: in-process batched sampling with a Hugging Face causal LM.

Used by default on one machine (CPU or one GPU) and behind the stand-in SGLang server in tests.
Prompts are left-padded into one batch (attention mask + position ids = running count of real
tokens), prefilled once, then decoded token by token with the model's KV cache. Sampling:
temperature, top-k, top-p, per-request stop ids and the model's EOS, seeded by a private
`torch.Generator`. Each sampled token's log-prob is log softmax(logits / T) over the full
vocabulary (before top-k/top-p), see `megatron_gspo.rollout.engine`.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from megatron_gspo.data.sample import Sample
from megatron_gspo.quant.fp8_stream import dequantize_named, has_fp8
from megatron_gspo.rollout.embedded_batch import (  # noqa: F401  (filter_logits: callers)
    draw,
    filter_logits,
    prepare_rows,
)
from megatron_gspo.rollout.embedded_model import build_hf_model  # noqa: F401  (callers)
from megatron_gspo.rollout.embedded_moe import (  # noqa: F401  (names used by callers)
    RoutingCapture,
    fused_expert_slice,
    moe_routers,
)
from megatron_gspo.rollout.speculative_control import DraftControl
from megatron_gspo.rollout.engine import (
    Bucket,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    make_sample,
    plan_slots,
)

class EmbeddedEngine(RolloutEngine):
    """In-process rollout engine around a transformers causal LM.

    Args:
        model: directory, HF config dict or module (see `build_hf_model`).
        dtype: weights/compute dtype ("float32" for exact log-prob checks).
        device: "cpu", "cuda", ...
        seed: seed of the sampling generator.
        eos_token_ids: ids that end a sample unless `ignore_eos`; None = from the model config.
        max_batch_samples: most sequences decoded together (larger batches are split).
        max_model_len: prompt + response limit; None = the config's max_position_embeddings.
        default_sampling: used for requests without sampling params.
        attn_implementation: transformers attention backend.
        return_routing: MoE models: give every sample the top-k experts each layer's router
            chose for each token the model processed (`Sample.routing`, see `sample_rows`).
        draft_steps: > 0: speculative rollouts drafted by the model's MTP head, this many
            tokens per verification (`rollout.embedded_speculative`); its weights come from
            `model`'s safetensors when it is a directory holding them, else from weight
            updates (``model.layers.{num_hidden_layers}.*``). Not with `return_routing`.
        draft_control: when to draft (`rollout.speculative_control.DraftControl`; default:
            always, once the head has weights).
    """

    def __init__(
        self,
        model: str | os.PathLike | dict[str, Any] | torch.nn.Module,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        max_batch_samples: int = 256,
        max_model_len: int | None = None,
        default_sampling: SamplingParams | None = None,
        attn_implementation: str = "sdpa",
        return_routing: bool = False,
        draft_steps: int = 0,
        draft_control: DraftControl | None = None,
    ) -> None:
        super().__init__(default_sampling)
        self.device = torch.device(device)
        self.model = build_hf_model(model, dtype, device, attn_implementation)
        cfg = self.model.config
        if eos_token_ids is None:
            eos = getattr(cfg, "eos_token_id", None)
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.max_model_len = max_model_len or int(getattr(cfg, "max_position_embeddings", 4096))
        if max_batch_samples < 1:
            raise ValueError(f"max_batch_samples must be >= 1, got {max_batch_samples}")
        self.max_batch_samples = max_batch_samples
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._version = 0
        self._released = False
        self._lock = threading.Lock()  # one forward at a time (model and generator are shared)
        self._params = dict(self.model.named_parameters())
        self._params.update(dict(self.model.named_buffers()))
        fwd = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in fwd else "past_key_values"
        self._routers = moe_routers(self.model)
        if return_routing and not self._routers:
            raise ValueError("return_routing: the model has no MoE router (not an MoE model)")
        self.return_routing = bool(return_routing)
        self.draft, self.draft_steps = None, int(draft_steps)
        self.draft_control = draft_control or DraftControl(adaptive=False)
        if self.draft_steps > 0:
            self._build_draft(model)
        elif draft_control is not None:
            raise ValueError("draft_control without draft_steps: nothing drafts")

    def _build_draft(self, model) -> None:
        """The MTP draft head (`rollout.mtp_draft`), its tensors in `self._params`."""
        from megatron_gspo.rollout.mtp_draft import MTPDraft, mtp_tensors_in

        if self.return_routing:
            raise ValueError("speculative drafting with return_routing (MoE routing replay of "
                             "the engine's routing) is not supported: the verification's "
                             "rejected slots have no routing to replay; draft_steps 0")
        types = set(getattr(self.model.config, "layer_types", None) or ())
        if types & {"indexed_attention", "linear_attention"}:
            raise ValueError("speculative drafting needs a model whose cache can hold masked "
                             "slots; linear-attention / indexed-attention layers cannot")
        self.draft = MTPDraft(self.model)
        self._params.update(self.draft.named_tensors())
        if isinstance(model, (str, os.PathLike)):
            found = mtp_tensors_in(model, self.draft.layer_index)
            if found:
                self.draft.load_named(found)
                self.draft_control.ready = True

    # ---------------------------------------------------------------- state
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    # --------------------------------------------------------------- weights
    def param_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of the parameter a weight update names `name` (None: no such parameter)."""
        param = self._params.get(name)
        if param is None:
            param = fused_expert_slice(self._params, name)
        return None if param is None else tuple(param.shape)

    def load_buckets(self, buckets: Iterable[Bucket], version: int) -> int:
        """Copy HF-named tensors into the model; then set the version.

        Args:
            buckets: iterables of (name, tensor) with full shapes.
            version: the new weight version.
        Returns:
            number of tensors loaded.
        """
        n = 0
        with self._lock, torch.no_grad():
            for bucket in buckets:
                bucket = list(bucket)
                if has_fp8(bucket):  # block-FP8 weights and scales (W8A16: dequantized here)
                    bucket = dequantize_named(bucket, torch.float32)
                for name, tensor in bucket:
                    param = self._params.get(name)
                    if param is None:
                        param = fused_expert_slice(self._params, name)
                    if param is None:
                        raise KeyError(f"weight update: unknown parameter name {name!r}")
                    if tuple(param.shape) != tuple(tensor.shape):
                        raise ValueError(
                            f"weight update: {name} has shape {tuple(tensor.shape)}, "
                            f"model expects {tuple(param.shape)}"
                        )
                    param.copy_(tensor.to(device=param.device, dtype=param.dtype))
                    n += 1
                    if self.draft is not None and self.draft.owns(name):
                        self.draft_control.ready = True
            self._version = int(version)
        return n

    def speculative_metrics(self) -> dict[str, float]:
        """The drafting decisions and acceptance since the last call (`speculative/*`; {}
        without a draft head)."""
        return self.draft_control.metrics() if self.draft is not None else {}

    async def aupdate_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        await asyncio.to_thread(self.load_buckets, buckets, version)

    def set_version(self, version: int) -> None:
        """Set the weight version without touching weights."""
        self._version = int(version)

    # ---------------------------------------------------------------- memory
    async def arelease_memory(self, tags: Sequence[str] | None = None) -> None:
        """Move the model off the accelerator (one memory region: `tags` are ignored)."""
        if self.device.type != "cpu":
            with self._lock:
                self.model.to("cpu")
                if self.draft is not None:
                    self.draft.to("cpu")
                torch.cuda.empty_cache()
        self._released = True

    async def aresume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Move the model back (one memory region: `tags` are ignored)."""
        if self.device.type != "cpu":
            with self._lock:
                self.model.to(self.device)
                if self.draft is not None:
                    self.draft.to(self.device)
        self._released = False

    async def ahealth(self) -> bool:
        return not self._released

    # ------------------------------------------------------------ generation
    async def agenerate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        return await asyncio.to_thread(self.generate_sync, requests)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        """Synchronous generation straight on the caller's thread (no event loop needed)."""
        return self.generate_sync(requests)

    def generate_sync(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        """Sample all requests; each request's n samples are adjacent, in request order."""
        if self._released:
            raise RuntimeError("embedded engine memory is released; call resume_memory() first")
        slots, params = plan_slots(requests, self.default_sampling)
        results: list[Sample | None] = [None] * len(slots)
        for start in range(0, len(slots), self.max_batch_samples):
            chunk = slots[start : start + self.max_batch_samples]
            rows = [
                (requests[s.request_idx].prompt_ids, params[s.request_idx]) for s in chunk
            ]
            with self._lock:
                outs = self.sample_rows(rows, with_routing=self.return_routing)
            for s, (ids, lps, reason, *routing) in zip(chunk, outs, strict=True):
                results[s.out_idx] = make_sample(
                    requests[s.request_idx], s.request_idx, s.out_idx, ids, lps, reason,
                    self._version,
                )
                if routing:
                    results[s.out_idx].routing = routing[0]
                    results[s.out_idx].validate()
        return [r for r in results if r is not None]

    @torch.no_grad()
    def sample_rows(
        self, rows: Sequence[tuple[Sequence[int], SamplingParams]], with_routing: bool = False
    ) -> list[tuple]:
        """Decode one batch of independent rows.

        Args:
            rows: (prompt ids, sampling params) per sequence.
            with_routing: also return each row's routing (MoE models).
        Returns:
            (response ids, log-probs, finish reason) per row, plus, with `with_routing`, an int32
            tensor [P + R - 1, layers, top-k] of the experts every layer's router chose for each
            token the model processed: the P prompt tokens and the first R - 1 response tokens
            (the last sampled token is never fed to the model, so it has no routing; SGLang's
            `return_routed_experts` has the same rows).
        """
        if with_routing and not self._routers:
            raise ValueError("routing requested from a model without MoE routers")
        capture = RoutingCapture(self._routers) if with_routing else None
        try:
            outs = self._sample_rows(rows, capture)
        finally:
            if capture is not None:
                capture.close()
        if capture is None:
            return outs
        lens = [len(p) for p, _ in rows]
        return [(*o, capture.rows(i, lens[i], max(lens), len(o[0]) - 1))
                for i, o in enumerate(outs)]

    def _sample_rows(self, rows, capture: RoutingCapture | None) -> list[tuple]:
        from transformers import DynamicCache

        dev = self.device
        batch = prepare_rows(rows, dev, self.eos_token_ids, self.max_model_len)
        if self.draft is not None and capture is None and self.draft_control.decide(batch.size):
            from megatron_gspo.rollout.embedded_speculative import speculative_decode

            outs, counts = speculative_decode(self.model, self.draft, batch, self.draft_steps,
                                              self._cache_kw, self.generator, self._version,
                                              self.max_model_len)
            self.draft_control.record(counts)
            return outs
        bsz, steps, mask = batch.size, max(batch.budget), batch.mask
        out_ids: list[list[int]] = [[] for _ in range(bsz)]
        out_lps: list[list[float]] = [[] for _ in range(bsz)]
        reasons = ["length"] * bsz
        done = [False] * bsz

        # DSA models (DeepSeek-V3.2, GLM-5) keep their indexer keys in the cache layers their
        # config's `indexed_attention` layer types select, delta-net hybrids (Qwen3-Next) their
        # conv / recurrent states in its `linear_attention` layers; others the plain cache
        types = getattr(self.model.config, "layer_types", None) or ()
        typed = {"indexed_attention", "linear_attention"} & set(types)
        cache = DynamicCache(config=self.model.config) if typed else DynamicCache()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        kw = {self._cache_kw: cache, "use_cache": True, "logits_to_keep": 1}
        logits = self.model(input_ids=batch.ids, attention_mask=mask, position_ids=pos,
                            **kw).logits[:, -1, :]  # [B, V]
        next_pos = pos[:, -1:] + 1  # [B, 1]
        if capture is not None:
            capture.end_forward()
        for step in range(steps):
            scaled, logp, probs = batch.distributions(logits, self.weight_version)  # [B, V]
            sampled = draw(probs, batch.row_gens, self.generator)  # [B]
            tok = torch.where(batch.greedy, scaled.argmax(-1), sampled)  # [B]
            tok_lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)  # [B]
            tok_l, lp_l = tok.tolist(), tok_lp.tolist()
            for i in range(bsz):
                if done[i]:
                    continue
                out_ids[i].append(tok_l[i])
                out_lps[i].append(lp_l[i])
                if tok_l[i] in batch.stops[i]:
                    done[i], reasons[i] = True, "stop"
                elif len(out_ids[i]) >= batch.budget[i]:
                    done[i] = True
            if all(done) or step == steps - 1:
                break
            mask = torch.cat([mask, torch.ones(bsz, 1, dtype=mask.dtype, device=dev)], dim=-1)
            logits = self.model(
                input_ids=tok.unsqueeze(-1), attention_mask=mask, position_ids=next_pos, **kw
            ).logits[:, -1, :]
            next_pos = next_pos + 1
            if capture is not None:
                capture.end_forward()
        return [(out_ids[i], out_lps[i], reasons[i]) for i in range(bsz)]


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, prompt_ids: Sequence[int], response_ids: Sequence[int],
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of response tokens from one full forward pass (the learner's view, unpadded).

    Args:
        model: the causal LM.
        prompt_ids: prompt ids.
        response_ids: response ids.
        temperature: logits are divided by it (0 means 1, as for greedy sampling).
    Returns:
        [R] float32 log-probs.
    """
    dev = next(model.parameters()).device
    tokens = torch.tensor([list(prompt_ids) + list(response_ids)], device=dev)  # [1, T]
    logits = model(input_ids=tokens).logits[0].float()  # [T, V]
    t = temperature if temperature >= 1e-6 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)
    p = len(prompt_ids)
    tgt = tokens[0, p:]  # [R]
    return logp[p - 1 : -1].gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
