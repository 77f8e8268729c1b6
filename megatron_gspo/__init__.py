"""megatron-gspo: Group Sequence Policy Optimization (arXiv 2507.18071) with a Megatron-Core
learner and SGLang rollouts."""

__version__ = "0.1.0"
