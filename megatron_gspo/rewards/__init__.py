"""Reward functions: a registry by name (math answer checking, exact match) and
`module:function` loading of user code."""

from megatron_gspo.rewards.scoring import (
    RewardError,
    get_reward_fn,
    register_reward,
    registered_rewards,
    score_samples,
)

__all__ = ["RewardError", "get_reward_fn", "register_reward", "registered_rewards",
           "score_samples"]
