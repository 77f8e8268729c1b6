"""Test helpers for the agent package: a toy tokenizer and a scripted rollout engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from megatron_gspo.data.sample import Sample
from megatron_gspo.rollout.engine import (
    Bucket,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    make_sample,
)

SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
]
# multi-character tokens, so that decode -> encode is NOT the identity for split spellings
MERGES = ["12", "calc"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
VOCAB_SIZE = 128  # padded with reserved tokens


class ToyTokenizer:
    """Greedy longest-match tokenizer over specials, a few merges and single characters."""

    def __init__(self) -> None:
        base = SPECIALS + MERGES + CHARS
        self.vocab = base + [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(base))]
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self._pieces = sorted(SPECIALS + MERGES, key=len, reverse=True)
        self.unk = self.ids["?"]

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for p in self._pieces:
                if text.startswith(p, i):
                    out.append(self.ids[p])
                    i += len(p)
                    break
            else:
                out.append(self.ids.get(text[i], self.unk))
                i += 1
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(
            self.vocab[i] for i in ids if not (skip_special_tokens and self.vocab[i] in SPECIALS)
        )


class ScriptedEngine(RolloutEngine):
    """Deterministic engine: `script(prompt_ids, call_no) -> list of token ids` per request.

    Log-prob of the t-th generated token = -(0.01 * (t + 1) + 0.001 * (len(prompt) % 100)).
    Stops at the first token in the request's stop ids (kept), else "length" at max_new_tokens.
    """

    def __init__(self, script: Callable[[list[int], int], list[int]], delay_s: float = 0.0):
        super().__init__(SamplingParams(max_new_tokens=64))
        self.script = script
        self.delay_s = delay_s
        self.calls: list[tuple[list[int], list[int]]] = []  # (prompt ids, response ids)
        self.batch_sizes: list[int] = []
        self.fail: Exception | None = None

    @property
    def weight_version(self) -> int:
        return 3

    async def agenerate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        if self.fail is not None:
            raise self.fail
        self.batch_sizes.append(len(requests))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        out = []
        for r, req in enumerate(requests):
            sp = req.sampling or self.default_sampling
            toks = list(self.script(list(req.prompt_ids), len(self.calls)))
            ids, reason = [], "length"
            for t in toks[: sp.max_new_tokens]:
                ids.append(t)
                if t in sp.stop_token_ids:
                    reason = "stop"
                    break
            lps = [-(0.01 * (t + 1) + 0.001 * (len(req.prompt_ids) % 100)) for t in range(len(ids))]
            self.calls.append((list(req.prompt_ids), ids))
            out.append(make_sample(req, r, r, ids, lps, reason, self.weight_version))
        return out

    async def aupdate_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        raise NotImplementedError

    async def ahealth(self) -> bool:
        return True
