"""SGLang 0.5.12's real CPU server (tier `sglang_real`) takes the LoRA learner's partial weight
sync: after the first (full) sync only the adapted layers' merged weights are sent, and the
server must change exactly those and keep every other weight (verified by served log-probs
against the Hugging Face model holding the expected state)."""

from __future__ import annotations

import shutil

import pytest

from tests.rollout import _sglang_real as tier

tier.require_tier()
pytestmark = pytest.mark.sglang_real

from megatron_gspo.rollout.engine import RolloutError  # noqa: E402
from megatron_gspo.rollout.sglang.client import SGLangEngine  # noqa: E402
from megatron_gspo.rollout.sglang.weight_sync_endpoints import (  # noqa: E402
    PROBE_PROMPT,
    PROBE_TOLERANCE,
    check_sync_probe,
)

ADAPTED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "down_proj.weight")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "base"
    shutil.copytree(tier.TINY, d)
    logs = tier.install_dir() / "logs" / "lora"
    eng = SGLangEngine(launch=tier.spec(d, "float32", tier.API_KEY, str(logs)),
                       startup_timeout_s=600, request_timeout_s=120, vocab_size=128,
                       backoff_s=0.05)
    eng.sync(eng.astart())
    yield eng, d
    eng.shutdown()


def _verify(eng, model_dir, state, version):
    probes = eng.sync(eng.aprobe_servers(1.0))
    mine = tier.recompute(tier.hf_model(model_dir, state),
                          [(PROBE_PROMPT, ids) for _, ids, _ in probes])
    return check_sync_probe(version, probes, mine, PROBE_TOLERANCE["float32"])


def test_partial_sync_changes_only_the_sent_layers(server):
    eng, model_dir = server
    net = tier.hf_model(model_dir)
    orig = net.state_dict()
    new = tier.perturbed(net, 0.05, seed=7)
    sent = {k: v for k, v in new.items() if k.endswith(ADAPTED)}
    assert 0 < len(sent) < len(orig)
    eng.update_weights([list(sent.items())], version=1)
    assert _verify(eng, model_dir, {**orig, **sent}, 1) < PROBE_TOLERANCE["float32"]
    with pytest.raises(RolloutError, match="version 1 not verified"):
        _verify(eng, model_dir, new, 1)  # the weights not sent kept their values
