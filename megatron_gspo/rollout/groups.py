"""Group sampling for GSPO/GRPO: G responses per prompt, groups kept together, with optional
over-sampling and dropping of groups whose rewards have zero variance (their group advantages
are all zero, so they carry no learning signal; DAPO-style dynamic sampling).

`GroupSampler.collect` draws prompts, generates G samples each, scores them, drops groups with
a failed sample (the engine marks it with `metadata["rollout_error"]`: refused by the server or
aborted; its reward would skew the group baseline) and, when asked, zero-variance groups, and
repeats (asking for `oversample_factor` times the groups
still missing) until it has the requested number of groups, the prompts run out or
`max_rounds` is reached. Dropped groups are counted in the returned metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from megatron_gspo.data.sample import Sample
from megatron_gspo.rollout.engine import (
    GenerateRequest,
    RolloutEngine,
    RolloutError,
    SamplingParams,
)


def split_groups(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Samples grouped by group_index, groups in first-seen order, samples in input order."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


def has_zero_variance(group: Sequence[Sample], eps: float = 1e-8) -> bool:
    """True when every sample of the group has (numerically) the same reward.

    Raises:
        ValueError: a sample has no reward yet.
    """
    rewards = []
    for s in group:
        if s.reward is None:
            raise ValueError(f"sample {s.index} (group {s.group_index}) has no reward")
        rewards.append(float(s.reward))
    return max(rewards) - min(rewards) <= eps


def mark_failed_if_every_episode_failed(samples: Sequence[Sample]) -> None:
    """Agent mode (asynchronous rollouts): a group whose every episode ended in an error
    (`env_error`: environment, tool parser, chat template) holds no reward to learn from; its
    samples get the failed-sample mark, so the group is dropped and counted like one with a
    failed generation, and a run whose every episode fails stops with one line (the producer's
    `MAX_DROPPED_ROUNDS`) instead of training on reward 0, as the synchronous agent rollout
    stops on a step whose every episode failed."""
    if not samples or not all("env_error" in s.metadata for s in samples):
        return
    first = samples[0].metadata
    why = (f"every one of the group's {len(samples)} episodes failed; the first "
           f"{first.get('error_kind', 'environment')} error: {first['env_error']}")
    for s in samples:
        s.metadata.setdefault("rollout_error", why)


def renumber(groups: Sequence[Sequence[Sample]]) -> list[Sample]:
    """Flatten groups; set group_index to the group's position and index to the sample's.

    The original group index is kept in metadata["source_group"].
    """
    out: list[Sample] = []
    for g, group in enumerate(groups):
        for s in group:
            s.metadata.setdefault("source_group", s.group_index)
            s.group_index, s.index = g, len(out)
            out.append(s)
    return out


class GroupSampler:
    """Collects complete groups of `group_size` samples per prompt.

    Args:
        engine: the rollout engine.
        group_size: G, samples per prompt.
        score: fills `reward` of every sample in the list it is given (called once per round).
        sampling: sampling parameters (n is set to group_size).
        oversample_factor: prompts asked per missing group (>= 1).
        drop_zero_variance: drop groups whose rewards are all equal.
        max_rounds: most generate rounds per `collect`.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        group_size: int,
        score: Callable[[list[Sample]], None],
        sampling: SamplingParams | None = None,
        oversample_factor: float = 1.0,
        drop_zero_variance: bool = False,
        max_rounds: int = 4,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"rollout.group_size must be >= 1, got {group_size}")
        if oversample_factor < 1.0:
            raise ValueError(f"rollout.oversample_factor must be >= 1, got {oversample_factor}")
        if max_rounds < 1:
            raise ValueError(f"rollout.max_rounds must be >= 1, got {max_rounds}")
        self.engine, self.group_size, self.score = engine, group_size, score
        self.sampling = (sampling or engine.default_sampling).with_n(group_size)
        self.oversample_factor, self.drop_zero_variance = oversample_factor, drop_zero_variance
        self.max_rounds = max_rounds
        self._next_group = 0

    def collect(
        self, prompts: Iterator[GenerateRequest], num_groups: int
    ) -> tuple[list[Sample], dict[str, float]]:
        """Sample until `num_groups` groups are kept.

        Args:
            prompts: source of prompts (their sampling params are replaced).
            num_groups: groups wanted.
        Returns:
            (samples, metrics): renumbered samples (group by group) and counters:
            groups_generated, groups_kept, groups_zero_variance (dropped), groups_surplus
            (generated beyond need), groups_short (missing at the end), groups_failed (dropped
            for a failed sample), samples_failed, zero_variance_share, rounds,
            samples_generated.
        Raises:
            RolloutError: every sampled group had a failed sample (names the first failure).
        """
        kept: list[list[Sample]] = []
        m = {"groups_generated": 0, "groups_zero_variance": 0, "groups_surplus": 0,
             "groups_failed": 0, "samples_failed": 0, "rounds": 0, "samples_generated": 0}
        exhausted = False
        while len(kept) < num_groups and m["rounds"] < self.max_rounds and not exhausted:
            need = num_groups - len(kept)
            ask = math.ceil(need * self.oversample_factor)
            batch: list[GenerateRequest] = []
            for req in prompts:
                batch.append(replace(req, sampling=self.sampling, group_index=self._next_group))
                self._next_group += 1
                if len(batch) == ask:
                    break
            exhausted = len(batch) < ask
            if not batch:
                break
            m["rounds"] += 1
            samples = self.engine.generate(batch)
            self.score(samples)
            m["samples_generated"] += len(samples)
            for group in split_groups(samples):
                m["groups_generated"] += 1
                failed = sum("rollout_error" in s.metadata for s in group)
                m["samples_failed"] += failed
                if failed:
                    m["groups_failed"] += 1
                elif self.drop_zero_variance and has_zero_variance(group):
                    m["groups_zero_variance"] += 1
                elif len(kept) < num_groups:
                    kept.append(group)
                else:
                    m["groups_surplus"] += 1
        if not kept and m["groups_failed"] and m["groups_failed"] == m["groups_generated"]:
            first = next(s.metadata["rollout_error"] for s in samples
                         if "rollout_error" in s.metadata)
            raise RolloutError(f"every one of {m['groups_generated']} sampled groups has a failed "
                               f"sample; the last round's first failure: {first}")
        out = renumber(kept)
        m["groups_kept"] = len(kept)
        m["groups_short"] = num_groups - len(kept)
        m["zero_variance_share"] = m["groups_zero_variance"] / max(m["groups_generated"], 1)
        return out, {k: float(v) for k, v in m.items()}
