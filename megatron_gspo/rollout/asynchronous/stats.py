"""What asynchronous training reports each step, so a user can see staleness and length bias:
the staleness histogram of the trained samples (step minus the oldest weight version among a
sample's tokens) and the response-length (and, in agent mode, turn-count) distribution of the
trained samples next to that of every sample generated since the previous step (discarded
groups included).

Length bins are quarters of `max_new_tokens`: bin b holds lengths L with
floor(4 * L / max_new_tokens) == b (L = max_new_tokens falls in bin 3).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_gspo.data.sample import Sample

LENGTH_BINS = 4


def length_bin(length: int, max_new_tokens: int) -> int:
    """The quarter of `max_new_tokens` that `length` falls in (0..3)."""
    return min(LENGTH_BINS - 1, LENGTH_BINS * length // max(1, max_new_tokens))


def turns(s: Sample) -> int:
    """Model turns of an episode (1 for a single-turn sample)."""
    n = s.metadata.get("num_turns")
    if isinstance(n, (int, float)):
        return int(n)
    return (max(s.turn_ids) + 1) if s.turn_ids else 1


def staleness(s: Sample, step: int) -> int:
    """step - the oldest weight version among the sample's tokens."""
    versions = s.token_versions or [s.weight_version]
    return step - (min(versions) if versions else s.weight_version)


def step_report(trained: Sequence[Sample], generated: Sequence[Sample], step: int,
                max_staleness: int, max_new_tokens: int) -> dict[str, float]:
    """Metrics of one step (see the module docstring).

    Args:
        trained: the samples trained at `step`.
        generated: every sample finished since the previous step.
        step: the training step.
        max_staleness: k (histogram bins 0..k are always reported).
        max_new_tokens: response length limit (length bins).
    Returns:
        `async/staleness_<d>` (trained samples of staleness d), `async/staleness_max`,
        `async/staleness_over_bound` (samples beyond k; 0 unless the bound is broken),
        `async/partial_samples` (trained samples whose tokens span several versions),
        `async/length_{trained,generated}_{mean,bin<b>}` (bins are counts),
        `async/turns_{trained,generated}_mean`, `async/{trained,generated}_samples`.
    """
    m: dict[str, float] = {}
    ages = [staleness(s, step) for s in trained]
    for d in range(max_staleness + 1):
        m[f"async/staleness_{d}"] = float(sum(a == d for a in ages))
    m["async/staleness_max"] = float(max(ages)) if ages else 0.0
    m["async/staleness_over_bound"] = float(sum(a > max_staleness or a < 0 for a in ages))
    m["async/partial_samples"] = float(sum(len(set(s.token_versions or [])) > 1
                                           for s in trained))
    for name, group in (("trained", trained), ("generated", generated)):
        lengths = [len(s.response_ids) for s in group]
        m[f"async/{name}_samples"] = float(len(group))
        m[f"async/length_{name}_mean"] = sum(lengths) / len(lengths) if lengths else 0.0
        for b in range(LENGTH_BINS):
            m[f"async/length_{name}_bin{b}"] = float(
                sum(length_bin(n, max_new_tokens) == b for n in lengths))
        t = [turns(s) for s in group]
        m[f"async/turns_{name}_mean"] = sum(t) / len(t) if t else 0.0
    return m
