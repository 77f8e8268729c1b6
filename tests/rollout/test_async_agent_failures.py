"""An asynchronous agent run whose every episode fails stops with one line instead of training
on reward 0; a group with some good episodes still trains (issue 43, item 10)."""

from __future__ import annotations

import pytest

from megatron_gspo.data.sample import Sample
from megatron_gspo.rollout.engine import RolloutError
from tests.rollout.test_async_producer import ScriptedEngine, producer, train


def _episodes(failing):
    """Episodes of one model token each; `failing(pid, j)`: that episode ends in an
    environment error (as `agent.runner` reports it: reward 0, `env_error` in its metadata)."""

    def episodes(gated, requests, group_size):
        out = []
        for req in requests:
            for j in range(group_size):
                pid = req.metadata["pid"]
                meta = {"pid": pid, "weight_versions": [gated.weight_version]}
                if failing(pid, j):
                    meta.update(env_error="KeyError: 'tool'", error_kind="environment",
                                stop_reason="env_error")
                out.append(Sample(list(req.prompt_ids), [7], rollout_logprobs=[-0.5],
                                  turn_ids=[0], reward=0.0 if failing(pid, j) else float(j % 2),
                                  finish_reason="abort" if failing(pid, j) else "stop",
                                  metadata=meta))
        return out

    return episodes


def test_every_episode_failing_stops_the_async_run_with_one_line():
    eng = ScriptedEngine()
    prod = producer(eng, k=1, steps=6)
    prod.episodes = _episodes(lambda pid, j: True)
    prod.start()
    try:
        with pytest.raises(RolloutError) as e:
            prod.take(0, timeout=60)
    finally:
        prod.close()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("step 0: asynchronous rollout failed"), msg
    assert "every one of the group's 3 episodes failed; the first environment error: " \
           "KeyError: 'tool'" in msg, msg
    assert prod.counters["groups_failed"] >= 8  # MAX_DROPPED_ROUNDS x B groups in a row


def test_groups_with_a_good_episode_train_and_all_failed_groups_are_replaced():
    eng = ScriptedEngine()
    prod = producer(eng, k=1, steps=3)
    prod.episodes = _episodes(lambda pid, j: pid % 2 == 1 or j == 2)  # odd pids: all fail
    prod.start()
    try:
        run = train(prod, eng, 3)
    finally:
        prod.close()
    for _step, samples, _m in run:
        assert len(samples) == 2 * 3
        assert all(s.metadata["pid"] % 2 == 0 for s in samples)  # one failed episode: kept
        assert all("rollout_error" not in s.metadata for s in samples)
    assert prod.counters["groups_failed"] >= 3
