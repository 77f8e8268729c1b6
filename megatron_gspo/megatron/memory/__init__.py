"""The learner's memory: the per-GPU plan from numbers alone (plan), the plan of a run config and
the start-up check (report), and the learner's state off the accelerator while colocated servers
generate (offload)."""
