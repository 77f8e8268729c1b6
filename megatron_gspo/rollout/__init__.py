"""Rollout engines: turn prompts into `Sample`s and take new weights from the learner.

- `base`: the RolloutEngine protocol (async, with synchronous wrappers) and SamplingParams.
- `embedded`: in-process transformers engine (default on one machine, CPU or GPU).
- `sglang`: SGLang servers over HTTP (launch or attach, retries, weight sync, memory release);
  `sglang_launch`: server / router command lines and processes.
- `weight_sync`: SGLang's weight payload formats; the learner side of the NCCL update group.
- `standin_server`: SGLang's HTTP endpoints backed by the embedded engine (tests, CPU demos).
- `groups`: G samples per prompt, over-sampling, zero-variance group filtering.
"""
