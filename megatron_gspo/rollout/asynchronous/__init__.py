"""Asynchronous rollouts (`rollout.mode: async`): `producer` (a thread generating groups with the
newest weights while the learner trains, bounded staleness), `gate` (pause, update, continue:
weight updates run alone), `stats` (staleness and length-bias metrics) and `audit` (the precision
audit split into current-weight and stale samples). The package is not named `async`: that is a
Python keyword."""
