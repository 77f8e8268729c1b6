"""Everything that imports megatron.core: the Megatron-Core learner.

cpu (run without CUDA over gloo), parallel (layout checks, process groups), model (GPTModel
from a Hugging Face config), logprobs (vocab-parallel log-probs, context-parallel sums), step
(forward_step / loss_func and the loss normalisation), optimizer (DDP, Adam, LR schedule),
weights (full <-> sharded tensors), learner (the `Learner` object). Submodules are imported
explicitly; importing this package imports nothing heavy.
"""
