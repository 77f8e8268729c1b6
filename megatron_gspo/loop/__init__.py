"""The RL loop: `train` (the one loop, read top to bottom), `phases` (each phase of a step:
rollout, advantages, pi_old, KL reference, train, weight sync, evaluation), `build` (the objects
of a run from its config), `early_checks` (start-up checks that fail in one line before any
weight is loaded) and `evaluation` (mean@n and pass@k on held-out sets)."""
