"""The one data contract from rollout to loss: a `Sample` is one response (or one multi-turn
episode) to one prompt, with everything the learner needs to train on it.

Token layout: `tokens = prompt_ids + response_ids`; `loss_mask`, `rollout_logprobs` and
`turn_ids` are aligned with `response_ids` (one entry per response token). Tokens that the model
did not generate (tool or environment output in multi-turn episodes) have loss mask 0 and
rollout log-prob 0.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = ("stop", "length", "abort")
# Largest |reward| a Sample may carry: group means, squares and sums of rewards up to this size
# stay finite in float32 (whose largest value is 3.4e38), so advantages never turn NaN.
MAX_ABS_REWARD = 1e15


class SampleError(ValueError):
    """A sample whose fields disagree (lengths, masks, values)."""


@dataclass
class Sample:
    """One response to one prompt.

    Attributes:
        prompt_ids: prompt token ids.
        response_ids: generated token ids (and environment tokens in multi-turn episodes).
        loss_mask: 1 for tokens the model generated and is trained on, 0 otherwise; one per
            response token. Defaults to all ones.
        rollout_logprobs: log-probability of each response token under the rollout engine's
            (temperature-scaled) sampling distribution; 0.0 where loss_mask is 0. None when the
            engine returned none.
        turn_ids: turn index of each response token (multi-turn); None for single-turn.
        reward: scalar reward of the whole response (episode).
        turn_rewards: per-turn rewards for turn-level advantages (multi-turn), or None.
        advantage: filled in by the loop (scalar, or per-token list for GSPO-token).
        group_index: index of the prompt group this sample belongs to.
        index: position of the sample inside the batch (stable id; never reused in a batch).
        finish_reason: "stop", "length" or "abort".
        weight_version: version of the weights the engine generated with (the oldest one
            among the tokens when `token_versions` is set).
        token_versions: weight version that generated each response token (asynchronous
            rollouts, where a response can span weight updates); None: all `weight_version`.
        prompt: the prompt text or chat, for logging and rewards.
        label: the reference answer for the reward function, if any.
        metadata: free-form extras (environment info, tool-call counts, ...).
        routing: MoE models: the top-k experts the rollout engine's router chose for each
            processed token, int tensor [P + R - 1, layers, top-k] (prompt and response tokens;
            the last sampled token is never fed to the model and has no row); None when the
            engine returned none.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int] | None = None
    rollout_logprobs: list[float] | None = None
    turn_ids: list[int] | None = None
    reward: float | None = None
    turn_rewards: list[float] | None = None
    advantage: float | list[float] | None = None
    group_index: int = 0
    index: int = 0
    finish_reason: str = "stop"
    weight_version: int = 0
    prompt: Any = None
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    token_versions: list[int] | None = None
    routing: Any = None

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)
        self.validate()

    # ------------------------------------------------------------------ checks
    def _fail(self, msg: str) -> None:
        raise SampleError(f"sample {self.index} (group {self.group_index}): {msg}")

    def validate(self) -> None:
        """Check that the per-token fields line up with the response; raise SampleError."""
        n = len(self.response_ids)
        if len(self.prompt_ids) == 0:
            self._fail("empty prompt_ids")
        if len(self.loss_mask) != n:
            self._fail(f"loss_mask has {len(self.loss_mask)} entries for {n} response tokens")
        if any(m not in (0, 1) for m in self.loss_mask):
            self._fail("loss_mask entries must be 0 or 1")
        if self.rollout_logprobs is not None:
            if len(self.rollout_logprobs) != n:
                self._fail(
                    f"rollout_logprobs has {len(self.rollout_logprobs)} entries for {n} "
                    "response tokens"
                )
            for t, (lp, m) in enumerate(zip(self.rollout_logprobs, self.loss_mask, strict=True)):
                if m and (not math.isfinite(lp) or lp > 1e-4):
                    self._fail(f"rollout_logprobs[{t}] = {lp} is not a valid log-probability")
        if self.token_versions is not None and len(self.token_versions) != n:
            self._fail(f"token_versions has {len(self.token_versions)} entries for {n} response "
                       "tokens")
        if isinstance(self.routing, list):  # from `to_dict` (JSON)
            import torch

            self.routing = torch.tensor(self.routing, dtype=torch.int32)
        if self.routing is not None:
            shape = tuple(getattr(self.routing, "shape", ()))
            t = len(self.prompt_ids) + n
            if len(shape) != 3 or shape[0] not in (t - 1, t):
                self._fail(f"routing has shape {shape}, expected [{t - 1}, layers, top-k] for "
                           f"{t} tokens")
        if self.turn_ids is not None and len(self.turn_ids) != n:
            self._fail(f"turn_ids has {len(self.turn_ids)} entries for {n} response tokens")
        if self.finish_reason not in FINISH_REASONS:
            self._fail(f"finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")
        if isinstance(self.advantage, list) and len(self.advantage) != n:
            self._fail(f"advantage has {len(self.advantage)} entries for {n} response tokens")

    # --------------------------------------------------------------- accessors
    @property
    def tokens(self) -> list[int]:
        """prompt_ids + response_ids."""
        return list(self.prompt_ids) + list(self.response_ids)

    @property
    def num_trainable(self) -> int:
        """Number of response tokens with loss mask 1."""
        return int(sum(self.loss_mask))

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view (for logging / dumping rollouts)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if out["routing"] is not None:
            out["routing"] = out["routing"].tolist()
        return out
