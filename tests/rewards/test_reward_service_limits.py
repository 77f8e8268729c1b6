"""`reward.url` replies and services at the edges: numbers too large for a float and replies
nested too deep are one-line errors naming the URL; a service that trickles its reply is cut
off by the total per-request deadline; the example server scores right answers right whatever
thread asks."""

import json
import time

import pytest

from megatron_gspo.rewards import RewardError
from megatron_gspo.rewards.remote import RewardService

from tests.rewards.test_reward_service import Server, _items


@pytest.mark.parametrize("reply,match", [
    (b"[1" + b"0" * 400 + b"]", r"reward 0 of the batch \(sample 0\) is an integer of 401 digits; expected a finite"),
    (b"[1" + b"0" * 5000 + b"]", "reply is not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "reply is nested too deep"),
])
def test_replies_a_float_cannot_hold_are_one_line_errors(reply, match):
    with Server(lambda b, n: (200, reply)) as srv:
        with pytest.raises(RewardError, match=match) as e:
            RewardService(srv.url, retries=1).score_texts(_items(1))
    assert srv.url in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400
