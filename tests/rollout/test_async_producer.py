"""Asynchronous rollouts (`rollout/asynchronous/producer.py`) against a scripted engine: the
staleness bound, per-token weight versions across a partial rollout, abort/regenerate, no group lost
or trained twice across pause/continue and a save/resume, and the length-bias report."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from megatron_gspo.data.datasets import PromptIterator
from megatron_gspo.data.sample import Sample
from megatron_gspo.rollout.asynchronous.producer import AsyncProducer
from megatron_gspo.rollout.asynchronous.stats import step_report
from megatron_gspo.rollout.engine import (
    GenerateRequest,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    make_sample,
)

P = 2  # prompt tokens: [target length, prompt id]


class ScriptedEngine(RolloutEngine):
    """Prompt [L, pid] + partial response r: answers the next tokens 100 + len(r), ... up to L
    in all (finish "stop" at L), at most max_new_tokens per request; every token's log-prob
    is -(version + 1) / 100, so a token tells which weights generated it. `delay_s` per request.
    """

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__(SamplingParams(max_new_tokens=8))
        self.delay_s, self._v, self.fail = delay_s, 0, None
        self.lock = threading.Lock()

    @property
    def weight_version(self) -> int:
        return self._v

    def generate(self, requests):
        if self.fail:
            raise RuntimeError(self.fail)
        time.sleep(self.delay_s)
        out = []
        for i, r in enumerate(requests):
            target, done = r.prompt_ids[0], len(r.prompt_ids) - P
            n = min(r.sampling.max_new_tokens, target - done)
            ids = [100 + done + t for t in range(n)]
            out.append(make_sample(r, i, i, ids, [-(self._v + 1) / 100] * n,
                                   "stop" if done + n == target else "length", self._v))
        return out

    async def agenerate(self, requests):
        return await asyncio.to_thread(self.generate, requests)

    async def aupdate_weights(self, buckets, version):
        self._v = version

    async def ahealth(self):
        return True


def producer(engine, *, k=1, B=2, G=3, steps=6, chunk=8, mode="continue", start=0,
             lengths=(3, 8, 5, 1, 8, 2, 7), max_new=8, drop_zero_variance=False):
    prompts = PromptIterator(list(range(1000)), shuffle=False)

    def to_request(pid: int) -> GenerateRequest:
        return GenerateRequest([lengths[pid % len(lengths)], pid], metadata={"pid": pid})

    def score(samples):
        for s in samples:
            s.reward = float(s.index % 2 if s.metadata["pid"] % 3 else 0)  # pid 0, 3, ...: equal

    return AsyncProducer(engine, prompts, to_request, score, SamplingParams(max_new_tokens=max_new),
                         group_size=G, groups_per_step=B, max_staleness=k, max_steps=steps,
                         start_step=start, update_in_flight=mode, chunk_tokens=chunk,
                         drop_zero_variance=drop_zero_variance)


def produce_and_train(engine, steps, learner_s=0.0, **producer_kw):
    """A producer of `steps` steps started, trained to the end (`train`) and closed.
    Returns (producer, train's output)."""
    prod = producer(engine, steps=steps, **producer_kw).start()
    try:
        return prod, train(prod, engine, steps, learner_s=learner_s)
    finally:
        prod.close()


def train(prod, engine, steps, start=0, learner_s=0.0, on_step=None):
    """The training loop's use of a producer: take, 'train', update the weights."""
    out = []
    for step in range(start, steps):
        samples, m = prod.take(step, timeout=60)
        out.append((step, samples, m))
        time.sleep(learner_s)
        if on_step:
            on_step(step)
        with prod.updating():
            engine._v = step + 1
    return out


def versions(s: Sample) -> list[int]:
    return [round(-lp * 100) - 1 for lp in s.rollout_logprobs]


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("engine_s,learner_s", [(0.0, 0.03), (0.03, 0.0)])
def test_staleness_bound_never_exceeded(k, engine_s, learner_s):
    eng = ScriptedEngine(engine_s)
    prod, run = produce_and_train(eng, 8, learner_s=learner_s, k=k)
    worst = 0
    for step, samples, m in run:
        for s in samples:
            assert min(s.token_versions) >= step - k, (step, s.token_versions)
            assert s.weight_version == min(s.token_versions)
            worst = max(worst, step - s.weight_version)
        assert m["async/staleness_over_bound"] == 0
        assert sum(m[f"async/staleness_{d}"] for d in range(k + 1)) == len(samples)
    if engine_s == 0.0:  # a fast engine runs ahead as far as the bound allows, no further
        assert worst == k


def test_partial_rollout_token_versions():
    eng = ScriptedEngine(0.01)
    prod, run = produce_and_train(eng, 6, learner_s=0.02, k=1, chunk=2, lengths=(8,))
    partial = 0
    for _step, samples, _m in run:
        for s in samples:
            assert s.response_ids == [100 + t for t in range(8)]  # continued, not restarted
            assert s.token_versions == versions(s)  # each token: the weights that made it
            assert s.token_versions == sorted(s.token_versions)
            partial += len(set(s.token_versions)) > 1
    assert partial > 0
    assert prod.counters["samples_continued"] > 0 and prod.counters["samples_restarted"] == 0


class RoutingEngine(ScriptedEngine):
    """ScriptedEngine of an MoE model: each request routes every position it processes
    (prompt + partial response, all but the last sampled token) to experts (version, position)."""

    def generate(self, requests):
        out = super().generate(requests)
        for r, s in zip(requests, out, strict=True):
            t = len(r.prompt_ids) + len(s.response_ids)
            s.routing = torch.tensor([[[self._v, j]] for j in range(t - 1)], dtype=torch.int32)
        return out


@pytest.mark.parametrize("mode", ["continue", "abort"])
def test_partial_rollout_keeps_each_positions_first_routing(mode):
    """Continued responses: the routing row of position j is the one of the request that first
    processed j, i.e. of the weights that gave the log-prob of the token j predicts."""
    eng = RoutingEngine(0.01)
    prod, run = produce_and_train(eng, 6, learner_s=0.02, k=1, chunk=3, lengths=(8,), mode=mode)
    spans = 0
    for _step, samples, _m in run:
        for s in samples:
            t = P + len(s.response_ids)
            assert s.routing is not None and tuple(s.routing.shape) == (t - 1, 1, 2)
            assert s.routing[:, 0, 1].tolist() == list(range(t - 1))  # no row lost or repeated
            assert s.routing[P - 1:, 0, 0].tolist() == s.token_versions
            assert set(s.routing[:P - 1, 0, 0].tolist()) == {s.token_versions[0]}
            spans += len(set(s.token_versions)) > 1
    assert (spans > 0) == (mode == "continue")


def test_abort_mode_regenerates_with_new_weights():
    eng = ScriptedEngine(0.01)
    prod, run = produce_and_train(eng, 6, learner_s=0.02, k=1, chunk=2, lengths=(8,), mode="abort")
    for _step, samples, _m in run:
        for s in samples:
            assert s.response_ids == [100 + t for t in range(8)]
            assert len(set(s.token_versions)) == 1 and s.token_versions == versions(s)
    assert prod.counters["samples_restarted"] > 0


def _pids(run):
    out = []
    for _step, samples, _m in run:
        groups = {}
        for s in samples:
            groups.setdefault(s.group_index, []).append(s)
        assert all(len(g) == 3 for g in groups.values())
        for g in groups.values():
            assert len({s.metadata["pid"] for s in g}) == 1
            out.append(g[0].metadata["pid"])
    return out


def test_no_group_lost_or_duplicated_across_pause_and_resume():
    steps, B, cut = 8, 2, 3
    eng = ScriptedEngine(0.02)
    prod = producer(eng, k=2, B=B, steps=steps, chunk=2).start()
    saved = {}

    def checkpoint(step):
        if step + 1 == cut:
            time.sleep(0.3)  # the admitted groups finish; the update admits new ones

    try:
        first = train(prod, eng, cut, on_step=checkpoint)
        t0 = time.time()  # the update lets the producer admit new groups: wait for them
        while not any(g.samples is None for g in prod._groups) and time.time() - t0 < 5:
            time.sleep(0.001)
        saved = prod.state_dict()  # after the update to version `cut`, as loop/train.py saves
    finally:
        prod.close()  # the 'killed' run: its in-flight responses are lost
    assert saved["finished"] and saved["redo"] and saved["taken"] == cut * B
    finished = {g["samples"][0]["metadata"]["pid"]: g["samples"] for g in saved["finished"]}
    eng2 = ScriptedEngine(0.005)
    eng2._v = cut
    prod2 = producer(eng2, k=2, B=B, steps=steps, chunk=2, start=cut)
    prod2.load_state_dict(saved)
    prod2.start()
    try:
        second = train(prod2, eng2, steps, start=cut)
    finally:
        prod2.close()
    pids = _pids(first) + _pids(second)
    assert sorted(pids) == list(range(steps * B))  # each prompt trained exactly once
    for _step, samples, _m in second:  # saved finished groups trained as they were
        for s in samples:
            if s.metadata["pid"] in finished:
                assert s.response_ids in [f["response_ids"] for f in finished[s.metadata["pid"]]]
    for step, samples, _m in first + second:
        assert all(s.weight_version >= step - 2 for s in samples)


def test_zero_variance_groups_replaced_not_counted():
    eng = ScriptedEngine()
    prod, run = produce_and_train(eng, 4, k=1, drop_zero_variance=True)
    for _step, samples, _m in run:
        assert len(samples) == 2 * 3
    assert prod.counters["groups_zero_variance"] > 0
    assert all(s.metadata["pid"] % 3 for _st, samples, _m in run for s in samples)


def test_length_report_equals_direct_count():
    eng = ScriptedEngine(0.002)
    prod = producer(eng, k=1, steps=5, chunk=3, lengths=(1, 2, 3, 4, 5, 6, 7, 8)).start()
    generated_direct = []
    try:
        run = train(prod, eng, 5)
    finally:
        prod.close()
    for _step, samples, m in run:
        lengths = [len(s.response_ids) for s in samples]
        for b, (lo, hi) in enumerate([(0, 2), (2, 4), (4, 6), (6, 9)]):  # quarters of 8
            assert m[f"async/length_trained_bin{b}"] == sum(lo <= n < hi for n in lengths)
        assert m["async/length_trained_mean"] == pytest.approx(sum(lengths) / len(lengths))
        assert m["async/trained_samples"] == len(samples)
        generated_direct.append(m["async/generated_samples"])
    assert sum(generated_direct) >= 5 * 2 * 3
    s = [Sample([1], [5] * n, token_versions=[v] * n, weight_version=v)
         for n, v in [(0, 3), (1, 3), (3, 2), (8, 2), (4, 1)]]
    m = step_report(s[:3], s, step=3, max_staleness=1, max_new_tokens=8)
    assert (m["async/staleness_0"], m["async/staleness_1"]) == (2, 1)
    assert m["async/staleness_over_bound"] == 0
    assert [m[f"async/length_generated_bin{b}"] for b in range(4)] == [2, 1, 1, 1]
    assert [m[f"async/length_trained_bin{b}"] for b in range(4)] == [2, 1, 0, 0]
    assert step_report(s, s, 3, 1, 8)["async/staleness_over_bound"] == 1  # the version-1 one


def test_engine_failure_reaches_the_learner_in_one_line():
    eng = ScriptedEngine()
    eng.fail = "server gone"
    prod = producer(eng).start()
    try:
        with pytest.raises(RolloutError, match="step 0: asynchronous rollout failed: "
                                               "RuntimeError: server gone"):
            prod.take(0, timeout=30)
    finally:
        prod.close()


def test_agent_episodes_span_weight_updates():
    """Episodes of two model turns (each turn one gated engine call): a weight update between
    the turns of an episode gives its tokens two versions, each its turn's."""
    eng = ScriptedEngine(0.01)

    def episodes(gated, requests, group_size):
        async def one(req, j):
            resp, tids, lps, versions = [], [], [], []
            for turn in range(2):
                sp = SamplingParams(max_new_tokens=3)
                out = (await gated.agenerate([GenerateRequest(req.prompt_ids + resp, sp)]))[0]
                resp += out.response_ids
                lps += out.rollout_logprobs
                tids += [turn] * len(out.response_ids)
                versions.append(out.weight_version)
                await asyncio.sleep(0.02)  # the environment's turn
            return Sample(req.prompt_ids, resp, rollout_logprobs=lps, turn_ids=tids,
                          reward=float(j % 2), metadata={"weight_versions": versions,
                                                         "pid": req.metadata["pid"]})

        async def run():
            return await asyncio.gather(*(one(r, j) for r in requests for j in range(group_size)))

        return list(asyncio.run(run()))

    prod = producer(eng, k=1, steps=6, lengths=(6,))
    prod.episodes = episodes
    prod.start()
    try:
        run = train(prod, eng, 6, learner_s=0.03)
    finally:
        prod.close()
    spans = 0
    for step, samples, m in run:
        for s in samples:
            assert s.token_versions == versions(s)  # a token's version is its turn's
            assert min(s.token_versions) >= step - 1
            spans += len(set(s.token_versions)) > 1
        assert m["async/turns_trained_mean"] == 2.0
    assert spans > 0
