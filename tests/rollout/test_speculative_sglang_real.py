"""The draft link loader (`gspo_delta_loader.link_draft`) on SGLang's real CPU server (tier
`sglang_real`). The real CPU server cannot draft (test_speculative_sglang_launch.py
`test_the_real_cpu_server_cannot_draft`), so what is checked here is the target's side, the part
that runs on every release: a server launched as the trainer launches it for distributed delta
syncs to a drafting server (`--custom-weight-loader gspo_delta_loader.load
gspo_delta_loader.link_draft`, the loader's folder on its PYTHONPATH) takes the empty `LINK`
update (SGLang dispatches the load format to the loader with its own model class, whose
`config.num_hidden_layers` the link reads), stays up, and then serves exactly the learner's
weights after distributed (gloo) delta syncs, the link wrapped under the delta wrapper: the sync
probe matches a recompute after every sync."""

from __future__ import annotations

import shutil

import pytest

from tests.rollout import _sglang_real as tier
from tests.rollout.test_sglang_real_delta import _learner, _step, _sync, _verify

tier.require_tier()
pytestmark = pytest.mark.sglang_real

from megatron_gspo.rollout.delta.sender import DeltaSender  # noqa: E402
from megatron_gspo.rollout.sglang import weight_sync_delta as delta_sync  # noqa: E402
from megatron_gspo.rollout.sglang.client import SGLangEngine  # noqa: E402
from megatron_gspo.rollout.sglang.launch import LaunchSpec  # noqa: E402
from megatron_gspo.rollout.sglang.speculative import LINK, link_launch_extras  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "base"
    shutil.copytree(tier.TINY, d)
    return d


def test_the_link_loader_on_a_real_server_keeps_distributed_deltas_exact(model_dir, tmp_path):
    from megatron_gspo.megatron.parallel import free_port

    base = tier.spec(model_dir, "bfloat16", tier.API_KEY, str(tier.install_dir() / "logs" /
                                                               "draft_link"))
    extra, env = delta_sync.launch_extras(base.env, "on", "copy", str(tmp_path / "loader"))
    extra, env = link_launch_extras(extra, env)
    assert extra == ("--custom-weight-loader", delta_sync.LOADER, LINK)
    spec = LaunchSpec(**{**base.__dict__, "extra_args": (*base.extra_args, *extra), "env": env})
    launched = SGLangEngine(launch=spec, startup_timeout_s=600, request_timeout_s=120,
                            vocab_size=128, backoff_s=0.05, max_retries=0)
    eng = None
    try:
        launched.sync(launched.astart())
        url = launched.urls[0]
        assert LINK in launched.server_info[url]["custom_weight_loader"]
        eng = SGLangEngine(server_urls=launched.urls, api_key=tier.API_KEY, vocab_size=128,
                           backoff_s=0.05, weight_sync="distributed",
                           dist_master=("127.0.0.1", free_port()), dist_backend="gloo")
        eng.delta = DeltaSender("on")
        w = _learner(model_dir)
        for v in (1, 2, 3):
            if v == 2:  # the delta wrapper is installed (sync 1): the link goes under it
                eng.sync(eng.astart())
                eng.sync(eng.abegin_update_sessions())  # 0.5.23: updates inside a session
                entries = eng.serialize_entries([], v)
                for _ in range(2):  # twice: the second call changes nothing
                    eng.sync(eng._post(url, "/update_weights_from_tensor", {
                        "serialized_named_tensors": entries, "load_format": LINK,
                        "flush_cache": False}))
                eng.sync(eng.aend_update_sessions())
            st = _sync(eng, w, v)
            assert st.delta == (v > 1)
            _verify(eng, model_dir, w, v)
            w = _step(w, 0.02, seed=v)
        assert all(p.alive() for p in launched.procs)
    finally:
        if eng is not None:
            eng.shutdown()
        launched.shutdown()
