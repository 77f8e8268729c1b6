"""The RolloutEngine protocol: turn prompt token ids into `Sample`s, take new weights, free and
take back accelerator memory.

Every engine is async inside (so many requests can be in flight against remote servers) and
offers synchronous wrappers (`generate`, `update_weights`, ...) for the plain training loop. The
wrappers run the coroutines on one private event loop owned by the engine (a daemon thread), so
long-lived HTTP sessions stay bound to a single loop.

Log-probability convention (all engines): `Sample.rollout_logprobs[t]` is
log softmax(logits_t / temperature)[token_t] over the FULL vocabulary, i.e. before top-k / top-p
truncation. That is the distribution the learner evaluates when it recomputes pi_old, so the two
are comparable. With temperature 0 (greedy) the log-prob is taken at temperature 1.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from megatron_gspo.data.sample import Sample
from megatron_gspo.runtime import device_ledger

T = TypeVar("T")

#: A bucket of weights: Hugging Face parameter names and full (unsharded) tensors.
Bucket = Iterable[tuple[str, torch.Tensor]]
# Memory regions a colocated engine releases and resumes separately (SGLang srt/constants.py
# GPU_MEMORY_ALL_TYPES; the tags of /release_memory_occupation and /resume_memory_occupation).
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class RolloutError(RuntimeError):
    """A rollout engine could not produce what was asked (server down, bad answer, ...)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
        max_new_tokens: most tokens to generate per sample.
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling mass (1.0 = off).
        top_k: keep the k most likely tokens (-1 or 0 = off).
        n: samples per prompt (a group).
        stop_token_ids: extra token ids that end a sample (the stop token is kept in the output).
        ignore_eos: do not stop at the model's end-of-sequence token(s).
        seed: this sample's own sampling seed (SGLang's `sampling_seed`; a server honours it
            only when started with `--enable-deterministic-inference`), so what it draws does
            not depend on which other requests share its batch; None: the engine's stream.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"sampling.n must be >= 1, got {self.n}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(
                self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"sampling.seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when the temperature is (numerically) zero."""
        return self.temperature < 1e-6

    @classmethod
    def for_rollouts(cls, rollout: Any, tok: Any) -> SamplingParams:
        """The sampling parameters of a run's rollouts.

        Args:
            rollout: the `rollout` config section (max_new_tokens, temperature, top_p, top_k,
                group_size, stop_token_ids).
            tok: the tokenizer; its ChatML end tokens, end-of-sequence token and
                `generation_stop_ids` (when set) are added to the configured stop tokens.
        Returns:
            SamplingParams with n = the group size.
        """
        ids = [int(t) for t in rollout.stop_token_ids]
        vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}  # minimal tokenizers: none
        for t in ("<|im_end|>", "<|endoftext|>"):
            tid = tok.convert_tokens_to_ids(t) if t in vocab else None
            if tid is not None and tid not in ids:
                ids.append(int(tid))
        # the end-of-sequence token, and the model's generation_config.json stop ids
        # (`rollout.generation_config`: Gemma 3's <end_of_turn>), set by `loop.build.tokenizer`
        for t in (getattr(tok, "eos_token_id", None), *getattr(tok, "generation_stop_ids", ())):
            if t is not None and int(t) not in ids:
                ids.append(int(t))
        return cls(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                   top_p=rollout.top_p, top_k=rollout.top_k, n=rollout.group_size,
                   stop_token_ids=tuple(ids))

    def with_n(self, n: int) -> SamplingParams:
        """Copy with another n."""
        return replace(self, n=n)

    def to_sglang(self) -> dict[str, Any]:
        """The `sampling_params` JSON of one SGLang /generate call for ONE sample (n=1)."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k > 0 else -1,
            "ignore_eos": self.ignore_eos,
            "no_stop_trim": True,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


@dataclass
class GenerateRequest:
    """One prompt to sample `sampling.n` responses for.

    Attributes:
        prompt_ids: prompt token ids.
        sampling: sampling parameters; None means the engine's defaults.
        group_index: group id copied to every sample; None means the request's position.
        prompt, label, metadata: copied to every sample (for rewards and logging).
    """

    prompt_ids: list[int]
    sampling: SamplingParams | None = None
    group_index: int | None = None
    prompt: Any = None
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Slot:
    """Where one sample of a batch goes (internal bookkeeping shared by engines)."""

    request_idx: int
    sample_idx: int  # j in 0..n-1
    out_idx: int  # position in the flat output list


def plan_slots(
    requests: Sequence[GenerateRequest], default: SamplingParams
) -> tuple[list[_Slot], list[SamplingParams]]:
    """Expand requests into one slot per sample, in output order.

    Args:
        requests: the batch.
        default: sampling parameters for requests that carry none.
    Returns:
        (slots, params): slots in output order and the resolved params of each request.
    """
    slots: list[_Slot] = []
    params: list[SamplingParams] = []
    for r, req in enumerate(requests):
        if len(req.prompt_ids) == 0:
            raise ValueError(f"request {r}: empty prompt_ids")
        p = req.sampling or default
        params.append(p)
        for j in range(p.n):
            slots.append(_Slot(r, j, len(slots)))
    return slots, params


def sample_seed(base: int, call: int, index: int) -> int:
    """The sampling seed of sample `index` of generate call `call` of a step seeded `base`: a
    hash in [0, 2**63), the same on every process and in every batch the sample lands in."""
    digest = hashlib.blake2b(f"{base}:{call}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # [0, 2**63)


class SampleSeeds:
    """Per-sample seeds of one training step (`train.deterministic` with SGLang servers): the
    k-th sample of the c-th generate call since `base` was set gets `sample_seed(base, c, k)`,
    so a resumed run draws what an uninterrupted one drew, whichever server and batch."""

    def __init__(self, base: int) -> None:
        self.base, self.calls = int(base), 0

    def next_call(self) -> Any:
        """The seeds of the next generate call: a function of the sample's index."""
        call, self.calls = self.calls, self.calls + 1
        return lambda index: sample_seed(self.base, call, index)


def make_sample(
    req: GenerateRequest,
    req_idx: int,
    out_idx: int,
    response_ids: list[int],
    logprobs: list[float],
    finish_reason: str,
    weight_version: int,
    extra: dict[str, Any] | None = None,
) -> Sample:
    """Build the Sample of one generated response (validates lengths)."""
    meta = dict(req.metadata)
    if extra:
        meta.update(extra)
    return Sample(
        prompt_ids=list(req.prompt_ids),
        response_ids=list(response_ids),
        rollout_logprobs=list(logprobs),
        group_index=req_idx if req.group_index is None else req.group_index,
        index=out_idx,
        finish_reason=finish_reason,
        weight_version=weight_version,
        prompt=req.prompt,
        label=req.label,
        metadata=meta,
    )


class _LoopThread:
    """A private asyncio loop in a daemon thread; `run` blocks until a coroutine finishes."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("synchronous engine call from inside the engine's own loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class RolloutEngine(ABC):
    """Generates Samples and receives weights. Subclasses implement the `a*` coroutines."""

    def __init__(self, default_sampling: SamplingParams | None = None) -> None:
        self.default_sampling = default_sampling or SamplingParams()
        self.released_tags: set[str] = set()  # memory regions released and not yet resumed
        self.memory_calls: list[str] = []  # "release all", "resume weights", ... in call order
        self.weights_releases = 0  # releases of the `weights` region (a delta sync's base is gone)
        self._loop_thread: _LoopThread | None = None
        self._loop_lock = threading.Lock()

    # ------------------------------------------------------------- async API
    @property
    @abstractmethod
    def weight_version(self) -> int:
        """Version of the weights the engine currently generates with."""

    @abstractmethod
    async def agenerate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        """Sample every request; returns request-ordered samples, each request's n together."""

    @abstractmethod
    async def aupdate_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Load HF-named weights from buckets, then switch to `version`."""

    async def arelease_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free accelerator memory while the learner trains (colocated): the regions in `tags`
        (`MEMORY_TAGS`; None = all). Engines without accelerator memory keep this no-op."""
        return None

    async def aresume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take the regions in `tags` (None = all) back before the next update / generation."""
        return None

    @abstractmethod
    async def ahealth(self) -> bool:
        """True when the engine can generate."""

    async def ashutdown(self) -> None:
        """Stop everything the engine started."""
        return None

    # -------------------------------------------------------- sync wrappers
    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._loop_lock:
            if self._loop_thread is None:
                self._loop_thread = _LoopThread(f"{type(self).__name__}-loop")
        return self._loop_thread.run(coro)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        """Synchronous `agenerate`."""
        return self._run(self.agenerate(requests))

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Synchronous `aupdate_weights`."""
        self._run(self.aupdate_weights(buckets, version))

    @property
    def memory_released(self) -> bool:
        """True while some memory region is released."""
        return bool(self.released_tags)

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Synchronous `arelease_memory` of `tags` (None = all regions)."""
        self._run(self.arelease_memory(list(tags) if tags else None))
        device_ledger.note("sglang_release", list(tags or MEMORY_TAGS))
        self.released_tags |= set(tags or MEMORY_TAGS)
        self.weights_releases += "weights" in (tags or MEMORY_TAGS)
        self.memory_calls.append("release " + (",".join(tags) if tags else "all"))

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Synchronous `aresume_memory` of those `tags` (None = all) that are released; a
        no-op when none is."""
        todo = [t for t in (tags or MEMORY_TAGS) if t in self.released_tags]
        if not todo:
            return
        self._run(self.aresume_memory(todo))
        device_ledger.note("sglang_resume", todo)
        self.released_tags -= set(todo)
        self.memory_calls.append("resume " + ",".join(todo))

    def health(self) -> bool:
        """Synchronous `ahealth`."""
        return self._run(self.ahealth())

    def shutdown(self) -> None:
        """Synchronous `ashutdown`; also stops the private loop. Safe to call twice."""
        try:
            if self._loop_thread is not None:
                self._loop_thread.run(self.ashutdown())
            else:
                asyncio.run(self.ashutdown())
        finally:
            if self._loop_thread is not None:
                self._loop_thread.close()
                self._loop_thread = None

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
