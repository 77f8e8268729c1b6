"""Rollout engines: turn prompts into `Sample`s and take new weights from the learner.

At this level (what every engine shares):
- `engine`: the RolloutEngine protocol (async, with synchronous wrappers) and SamplingParams
  (`SamplingParams.for_rollouts`: a run's sampling parameters, made where requests are made).
- `embedded`: in-process transformers engine (default on one machine, CPU or GPU).
- `groups`: G samples per prompt, over-sampling, zero-variance group filtering.
- `weight_sync_payloads`: SGLang's weight payload formats; the learner side of the NCCL update
  group.

Sub-packages: `sglang/` (the SGLang engine: client, launcher, server lifecycle, protocol rules,
weight endpoints), `standin/` (stand-in server and router: test and bench equipment),
`asynchronous/` (producer, pause gate, staleness stats, async precision audit) and `multinode/`
(colocated servers on every node and their weight sync), `delta/` (the delta weight-sync codec).
"""
