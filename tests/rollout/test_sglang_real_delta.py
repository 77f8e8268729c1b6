"""Delta weight sync on SGLang 0.5.12's real CPU server (tier `sglang_real`): a bf16 server
launched with `--custom-weight-loader gspo_delta_loader.load` (the loader's folder on its
PYTHONPATH, as the trainer's launcher does) takes deltas by tensor, disk and distributed (gloo)
sync; the sync probe after every sync matches a recompute of the learner's weights, a delta sync
serves exactly what a full sync of the same weights serves, the tiny demo trains with deltas
(probe at every step), and a delta on a base the server lacks ends it (the loader refuses)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from tests.rollout import _sglang_real as tier
from tests.rollout.test_delta_sync_standin import _step as sparse_step

tier.require_tier()
pytestmark = pytest.mark.sglang_real

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams  # noqa: E402
from megatron_gspo.rollout.delta.sender import DeltaSender  # noqa: E402
from megatron_gspo.rollout.sglang import weight_sync_delta as delta_sync  # noqa: E402
from megatron_gspo.rollout.sglang.client import SGLangEngine  # noqa: E402
from megatron_gspo.rollout.sglang.launch import LaunchSpec  # noqa: E402
from megatron_gspo.rollout.sglang.weight_sync_endpoints import (  # noqa: E402
    PROBE_PROMPT,
    PROBE_TOLERANCE,
    check_sync_probe,
)

GREEDY = [GenerateRequest(p, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
          for p in ([5, 9, 12, 7], [20, 21, 22], [40, 3, 3, 17, 60])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "base"
    shutil.copytree(tier.TINY, d)
    return d


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    base = tier.spec(model_dir, "bfloat16", tier.API_KEY, str(tier.install_dir() / "logs" /
                                                               "delta"))
    extra, env = delta_sync.launch_extras(base.env, "on", "copy",
                                          str(tmp_path_factory.mktemp("loader")))
    spec = LaunchSpec(**{**base.__dict__, "extra_args": (*base.extra_args, *extra), "env": env})
    eng = SGLangEngine(launch=spec, startup_timeout_s=600, request_timeout_s=120,
                       vocab_size=128, backoff_s=0.05, max_retries=0)
    eng.sync(eng.astart())
    yield eng
    eng.shutdown()
    assert all(not p.alive() for p in eng.procs)


def _learner(model_dir):
    net = tier.hf_model(model_dir, dtype="bfloat16")
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _step(w, share, seed):
    """`share` of each tensor's elements move by 20% (big enough for the probe to see)."""
    return sparse_step(w, share, seed, scale=0.2)


def _verify(eng, model_dir, w, version):
    probes = eng.sync(eng.aprobe_servers(1.0))
    net = tier.hf_model(model_dir, {k: v.float() for k, v in w.items()}, "bfloat16")
    mine = tier.recompute(net, [(PROBE_PROMPT, ids) for _, ids, _ in probes])
    return check_sync_probe(version, probes, mine, PROBE_TOLERANCE["bfloat16"])


def _greedy(eng):
    return [(s.response_ids, s.rollout_logprobs) for s in eng.generate(GREEDY)]


def _sync(eng, w, version):
    items = sorted(w.items())
    eng.update_weights([items[:12], items[12:]], version)
    return eng.delta.stats


def test_tensor_deltas_serve_what_a_full_sync_serves(server, model_dir):
    server.delta = DeltaSender("on")
    w = _learner(model_dir)
    w = _step(w, 0.05, seed=0)
    st = _sync(server, w, 1)
    assert not st.delta and _verify(server, model_dir, w, 1) < 0.15
    for v in (2, 3, 4):
        w = _step(w, 0.02, seed=v)
        st = _sync(server, w, v)
        assert st.delta and st.bytes_sent < st.bytes_full / 3, st
        _verify(server, model_dir, w, v)
        print(f"real server v{v}: share {st.share():.4f}, {st.bytes_sent} of {st.bytes_full} "
              f"bytes, encode {st.encode_s:.3f} s, apply {st.apply_s:.3f} s")
    by_delta = _greedy(server)
    server.delta.invalidate("test: the same weights in full")
    assert not _sync(server, w, 5).delta
    assert _greedy(server) == by_delta  # bit for bit: same ids and log-probs


def test_disk_deltas(server, model_dir, tmp_path):
    sender = DeltaSender("on")
    w = _learner(model_dir)
    for v in (10, 11):
        items = sorted(w.items())
        server.sync(delta_sync.aupdate_delta(server, sender, [items], v, disk_dir=str(tmp_path)))
        assert sender.stats.delta == (v == 11)
        _verify(server, model_dir, w, v)
        w = _step(w, 0.02, seed=v)


def test_distributed_gloo_deltas(server, model_dir):
    from megatron_gspo.megatron.parallel import free_port

    eng = SGLangEngine(server_urls=server.urls, api_key=tier.API_KEY, vocab_size=128,
                       backoff_s=0.05, weight_sync="distributed",
                       dist_master=("127.0.0.1", free_port()), dist_backend="gloo")
    eng.delta = DeltaSender("on")
    try:
        w = _learner(model_dir)
        for v in (20, 21, 22):
            st = _sync(eng, w, v)
            assert st.delta == (v > 20)
            _verify(eng, model_dir, w, v)
            w = _step(w, 0.02, seed=v)
    finally:
        eng.shutdown()


@pytest.mark.timeout(1500)
def test_tiny_demo_trains_with_deltas(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "megatron_gspo.cli", "train", "examples/tiny/config.yaml",
         "--run-dir", str(run), "train.eval_interval=0", "logging.progress_bar=false",
         "logging.tensorboard=false", "logging.log_samples=0", *tier.train_args(),
         "train.max_steps=4", "checkpoint.interval=0", "rollout.colocate=false",
         "rollout.weight_sync=tensor", "rollout.weight_sync_delta=on",
         # a port of its own: another run's server on a shared port would reset the loader
         f"rollout.base_port={random.randrange(31000, 55000)}"],
        cwd=tier.ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    sync = [{k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("weight_sync/")}
            for r in rows]
    for i, s in enumerate(sync):
        print(f"step {i}: delta {s['delta']:.0f} share {s.get('delta_changed_share', -1):.4f} "
              f"bytes {s['delta_bytes_sent']:.0f}/{s['delta_bytes_full']:.0f} probe "
              f"{s['probe_max_diff']:.2g}")
    assert len(sync) == 4 and all(s["delta"] == 1.0 for s in sync)
    assert all(s["probe_max_diff"] < 1e-3 for s in sync)  # fp32: served = learner's
    assert "full (first sync)" in (run / "events.log").read_text()


def test_a_delta_on_an_unknown_base_ends_the_server(server, model_dir):
    """Last (it ends the module's server): the learner's checks skipped, a delta on a base
    the loader does not hold raises in the scheduler, which ends SGLang 0.5.12."""
    sender = DeltaSender("on")
    sender.acked_version, sender.invalid_reason, sender.base = 99, None, _learner(model_dir)
    sender.releases_seen = server.weights_releases

    async def unchecked(engine, s):
        return None

    delta_sync_check = delta_sync.acheck_base
    delta_sync.acheck_base = unchecked
    try:
        with pytest.raises(RolloutError):
            server.sync(delta_sync.aupdate_delta(server, sender, [sorted(_step(
                sender.base, 0.02, seed=1).items())], 100))
    finally:
        delta_sync.acheck_base = delta_sync_check
    server.procs[0].proc.wait(timeout=60)
    assert not server.procs[0].alive()
    log = (tier.install_dir() / "logs" / "delta" / "sglang_server_0.log").read_text()
    assert "full sync is needed" in log
