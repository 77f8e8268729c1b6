"""Weight-update sessions: SGLang 0.5.23 takes tensor and distributed updates only between
/begin_weight_update and /end_weight_update (400 otherwise); 0.5.12 has neither endpoint (404).
The client opens a session on every server that has them, closes it after the update (also
after a failed one), and remembers which servers have none."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_gspo.rollout.engine import RolloutError
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.standin.server import StandinServer
from megatron_gspo.rollout.weight_sync_payloads import tensor_update_payloads
from tests.rollout.test_sglang_real_findings import _post


@pytest.fixture(params=[False, True], ids=["0.5.12", "0.5.23"])
def server(request, engine, tiny_model_dir):
    srv = StandinServer(engine, model_path=tiny_model_dir,
                        weight_update_sessions=request.param).start_in_thread()
    yield srv
    srv.stop_thread()


def test_updates_inside_a_session_where_the_server_has_them(server, engine):
    body = tensor_update_payloads([("model.norm.weight", torch.ones(engine.model.config
                                                                    .hidden_size))], 1)[0][0]
    st, text = _post(server.url, "/update_weights_from_tensor", body)
    if server.weight_update_sessions:  # outside a session: refused, as SGLang 0.5.23
        assert st == 400 and "must run between begin_weight_update()" in json.loads(text)[
            "message"]
    else:
        assert st == 200
    eng = SGLangEngine(server_urls=[server.url], backoff_s=0.01)
    try:
        new = [(k, v.detach() + 0.01) for k, v in engine.model.named_parameters()]
        before = server.stats["weight_updates"]
        eng.update_weights([new], version=1)
        assert server.stats["weight_updates"] > before and eng.weight_version == 1
        assert eng._has_update_sessions == {server.url: server.weight_update_sessions}
        assert not server.session_open
        with pytest.raises(RolloutError, match="not sent"):  # fails after the session opened
            eng.update_weights([[("model.embed_tokens.weight", torch.zeros(3, 3))]], version=2)
        assert not server.session_open  # closed on the way out: the next update works
        eng.update_weights([new], version=3)
        assert eng.weight_version == 3 and not server.session_open
    finally:
        eng.shutdown()
