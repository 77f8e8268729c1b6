"""Adaptive speculative drafting (`rollout.speculative.adaptive`): per rollout batch (the rows
that decode together), draft or not from two measured inputs.

- Batch size: verification scores K+1 tokens per row where plain decoding scores one; with many
  rows decoding together the forward is compute-bound and the extra tokens cost what the
  accepted drafts save (verl measured -50% on one large-batch setup). Over `max_batch` rows:
  no drafting.
- Acceptance: accepted / drafted tokens, an exponential running mean over the drafted batches
  (weight `smoothing` on the newest). Below `min_acceptance`: no drafting, but one batch in
  `probe_interval` drafts again to measure it (the head trains online: acceptance recovers).

Before the engine holds the head's weights (no sync carried them yet) nothing is drafted.
`metrics()` gives the step's decisions and their inputs (keys `speculative/*`, declared in
`loop.metric_keys`); `REASONS` numbers the decisions for `speculative/reason`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# speculative/reason: what the last decision was based on
REASONS = {"on": 0, "probe": 1, "fixed": 2, "batch": 3, "acceptance": 4, "no_weights": 5}


@dataclass
class DraftControl:
    """On/off decisions for drafting, one per decode batch.

    Args:
        adaptive: decide from batch size and acceptance; False: always draft (when ready).
        max_batch: most rows decoding together that still draft.
        min_acceptance: running acceptance below which drafting stops (re-probed).
        probe_interval: while off for low acceptance, draft one batch in this many.
        smoothing: weight of the newest batch in the running acceptance.
    """

    adaptive: bool = True
    max_batch: int = 64
    min_acceptance: float = 0.3
    probe_interval: int = 5
    smoothing: float = 0.5
    ready: bool = False  # the head holds real weights
    acceptance: float | None = None  # running acceptance (None: never measured)
    _skipped: int = 0  # batches not drafted for low acceptance since the last probe
    _step: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.probe_interval < 1:
            raise ValueError(f"DraftControl: max_batch {self.max_batch} and probe_interval "
                             f"{self.probe_interval} must be >= 1")
        if not 0 <= self.min_acceptance <= 1 or not 0 < self.smoothing <= 1:
            raise ValueError(f"DraftControl: min_acceptance {self.min_acceptance} must be in "
                             f"[0, 1], smoothing {self.smoothing} in (0, 1]")

    def decide(self, rows: int) -> bool:
        """Whether the next batch of `rows` sequences drafts (the decision is recorded)."""
        if not self.ready:
            on, why = False, "no_weights"
        elif not self.adaptive:
            on, why = True, "fixed"
        elif rows > self.max_batch:
            on, why = False, "batch"
        elif self.acceptance is not None and self.acceptance < self.min_acceptance:
            self._skipped += 1
            on = self._skipped >= self.probe_interval
            why = "probe" if on else "acceptance"
            if on:
                self._skipped = 0
        else:
            on, why = True, "on"
        s = self._step
        s["batches"] = s.get("batches", 0) + 1
        s["rows"] = s.get("rows", 0) + rows
        s["drafted_rows"] = s.get("drafted_rows", 0) + (rows if on else 0)
        s["batch"], s["reason"] = rows, REASONS[why]
        return on

    def record(self, counts: dict) -> None:
        """Fold one drafted batch's counts (`embedded_speculative.speculative_decode`) in."""
        s = self._step
        for k in ("verify_steps", "drafted", "accepted", "emitted", "row_verifies"):
            s[k] = s.get(k, 0) + int(counts.get(k, 0))
        if counts.get("drafted"):
            a = counts["accepted"] / counts["drafted"]
            self.acceptance = a if self.acceptance is None else (
                self.smoothing * a + (1 - self.smoothing) * self.acceptance)

    def metrics(self) -> dict[str, float]:
        """The decisions and inputs since the last call (then reset); {} when none was made."""
        s, self._step = self._step, {}
        if not s:
            return {}
        out = {
            "speculative/on": s["drafted_rows"] / max(1, s["rows"]),
            "speculative/batch": float(s["batch"]),
            "speculative/reason": float(s["reason"]),
            "speculative/ready": float(self.ready),
        }
        if self.acceptance is not None:
            out["speculative/running_acceptance"] = float(self.acceptance)
        if s.get("drafted"):
            out["speculative/acceptance"] = s["accepted"] / s["drafted"]
            out["speculative/verify_steps"] = float(s["verify_steps"])
            verifies = max(1, s.get("row_verifies", 0))
            out["speculative/accepted_per_verify"] = s["accepted"] / verifies
            out["speculative/tokens_per_verify"] = s["emitted"] / verifies
        return out
