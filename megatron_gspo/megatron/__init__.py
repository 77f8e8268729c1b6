"""Everything that imports megatron.core: the Megatron-Core learner.

cpu (run without CUDA over gloo), parallel (layout checks, process groups), model (GPTModel
from a Hugging Face config), logprobs (vocab-parallel log-probs, context-parallel sums), step
(forward_step / loss_func and the loss normalisation), optimizer (DDP, Adam, LR schedule),
weights (full <-> sharded tensors), learner (the `Learner` object). Submodules are imported
explicitly; importing this package imports nothing heavy.
"""

from megatron_gspo.megatron.fallbacks import quiet_fallback_warnings

quiet_fallback_warnings()  # Megatron-Core's TE / apex import warnings -> one run-log line
