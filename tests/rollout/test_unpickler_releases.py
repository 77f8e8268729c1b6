"""The weight-payload check follows the served SGLang release (issue 53, defect 8): 0.5.12's
`SafeUnpickler` loads any global of an allowed module prefix, 0.5.23's only an exact list
(utils/common.py in each release), so a payload 0.5.12 loads can end a 0.5.23 server. The
engine checks each server's entries with the rule of the release its /server_info reports."""

from __future__ import annotations

import base64

import pytest
import torch

from megatron_gspo.rollout.engine import RolloutError
from megatron_gspo.rollout.sglang import versions as compat
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.standin.server import StandinServer
from megatron_gspo.rollout.weight_sync_payloads import payload_error, tensor_update_payloads


def _global(module: str, name: str) -> str:
    """A pickle (protocol 0 GLOBAL) of `module.name`, base64 as a payload entry."""
    return base64.b64encode(f"c{module}\n{name}\n.".encode()).decode()


# under an allowed prefix of 0.5.12, outside 0.5.23's exact list (its own comment names the
# first as the gadget the exact list keeps out)
GADGET = _global("sglang.srt.utils.common", "dynamic_import")
CHAINMAP = _global("collections", "ChainMap")


def test_payload_check_follows_the_served_release():
    old, new, unknown = (compat.unpickler_refusal({"version": v})
                         for v in ("0.5.12", "0.5.23", "standin"))
    for entry in (GADGET, CHAINMAP):
        assert payload_error(entry, old) is None  # 0.5.12 loads it
        for rule in (new, unknown, compat.unpickler_refusal({"version": "0.5.17"}),
                     compat.unpickler_refusal(None)):
            assert "Blocked unsafe global" in payload_error(entry, rule)
    assert "dynamic_import" in payload_error(GADGET, new)
    assert compat.unpickler_refusal({"version": "0.5.24.post1"}) is compat.exact_refusal
    for rule in (old, new, unknown):  # both refuse what 0.5.12 denies, and foreign modules
        assert payload_error(_global("os", "system"), rule)
        assert payload_error(_global("pathlib", "PurePosixPath"), rule)
    # what the learner sends passes both releases: flattened buckets of each dtype, plain lists
    for dtype in (torch.float32, torch.bfloat16):
        named = [("model.norm.weight", torch.ones(32, dtype=dtype)),
                 ("lm_head.weight", torch.zeros(4, 8, dtype=dtype))]
        for flat in (True, False):
            bodies, _ = tensor_update_payloads(named, 1, flattened=flat)
            for body in bodies:
                for entry in body["serialized_named_tensors"]:
                    assert payload_error(entry, old) is None
                    assert payload_error(entry, new) is None


def test_a_payload_a_0523_server_would_die_on_is_not_sent(engine, tiny_model_dir):
    srv = StandinServer(engine, model_path=tiny_model_dir).start_in_thread()
    eng = SGLangEngine(server_urls=[srv.url], backoff_s=0.01)
    try:
        eng.sync(eng.astart())
        eng.server_info[srv.url]["version"] = "0.5.23"  # what a 0.5.23 server reports
        with pytest.raises(RolloutError, match=r"Blocked unsafe global \(sglang\.srt\.utils\."
                                               r"common\.dynamic_import\).*not sent"):
            eng.sync(eng.apost_tensor_update([[GADGET]], "flattened_bucket", 1))
        assert srv.stats["weight_updates"] == 0 and eng.health()
    finally:
        eng.shutdown()
        srv.stop_thread()
