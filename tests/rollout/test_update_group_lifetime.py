"""The learner's side of the weight-update group ends with its engine: torch keeps a process
group by name for the process's life, so without `close_update_group` at shutdown a second
engine in the same process (a later test, a study's next arm, a restarted engine) fails to form
its own "weight_update_group" ("The specified group name has already been created"; seen in
the sglang_real tier when the delta tests ran before the gloo sync test)."""

from __future__ import annotations

import pytest

from megatron_gspo.megatron.parallel import free_port
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.weight_sync_payloads import init_learner_update_group


def _engine_with_a_group() -> SGLangEngine:
    eng = SGLangEngine(server_urls=["http://127.0.0.1:9"], backoff_s=0.01)
    # the learner's side exactly as `aconnect_distributed` forms it (world 1: no server joins)
    eng._update_group = init_learner_update_group("127.0.0.1", free_port(), 1,
                                                  "weight_update_group", backend="gloo")
    return eng


def test_shutdown_frees_the_group_name_for_the_next_engine():
    first = _engine_with_a_group()
    with pytest.raises(Exception, match="already been created"):
        init_learner_update_group("127.0.0.1", free_port(), 1, "weight_update_group",
                                  backend="gloo")
    first.shutdown()
    assert first._update_group is None
    second = _engine_with_a_group()  # raised "already been created" before the fix
    second.shutdown()
    assert second._update_group is None
