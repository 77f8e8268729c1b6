"""The RL loop: `train` (the one loop, read top to bottom), `startup` (the start-up phase before
the first step), `phases` (each phase of a step: rollout, advantages, pi_old, KL reference, train,
weight sync, evaluation), `weight_sync_phase` (the learner's weights into the engines),
`server_setup` (the SGLang servers of a run), `build` (the objects of a run from its config),
`early_checks` (start-up checks that fail in one line before any weight is loaded),
`resume_checks`, `stale_audit` and `evaluation` (mean@n and pass@k on held-out sets). Run-time
services (checkpoints, run lock, metrics) are `runtime/`'s."""
