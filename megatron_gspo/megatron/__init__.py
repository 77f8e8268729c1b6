"""Everything that imports megatron.core: the Megatron-Core learner.

At the top, the learner and its step: learner (the `Learner` object), learner_state (weights,
reference, checkpoints of a learner), step (forward_step / loss_func and the loss normalisation),
tp_logprobs (vocab-parallel log-probs, context-parallel sums), paired (one schedule over policy and
reference), optimizer and adam_step (DDP, Adam, LR schedule), parallel (layout checks, process
groups), cpu (run without CUDA over gloo), compat (Megatron-Core version differences), fallbacks
(missing TE / apex). Sub-packages by concept: models/ (the GPTModel builder and one module per
family, and full <-> sharded weights), lora/ (adapters, their checkpoints and PEFT files), memory/
(plan, report, offload), moe/ (routing replay), io/ (checkpoints, the export stream, conversion).
Inside the folder a sub-package imports only lower ones: the base modules (compat, fallbacks,
cpu, parallel) < models < lora, memory, moe < io < the learner's modules at the top
(tests/layout/import_graph.py).
Submodules are imported explicitly; importing this package imports nothing heavy.

The modules that moved into the sub-packages keep their old dotted paths as an error
(`megatron_gspo.MOVED`): importing `megatron_gspo.megatron.model` raises an ImportError that names
`megatron_gspo.megatron.models.builder`.
A megatron-core that cannot be imported beside the installed nvidia-resiliency-ext (0.17+ with
NVRx 0.4.x: its import-time NVRx check raises) is one ImportError line saying what to do
(`compat.nvrx_refusal`), raised at the first import of megatron.core.
"""

import importlib.abc
import sys

from megatron_gspo.megatron.compat import nvrx_refusal
from megatron_gspo.megatron.fallbacks import quiet_fallback_warnings


class _NvrxFinder(importlib.abc.MetaPathFinder):
    """At the first import of megatron.core: `compat.nvrx_refusal()` as an ImportError, instead
    of the traceback megatron-core's own NVRx check ends in."""

    refusal: str | None = None  # "" once checked and fine

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "megatron.core":
            if self.refusal is None:
                type(self).refusal = nvrx_refusal() or ""
            if self.refusal:
                raise ImportError(self.refusal, name=fullname)
        return None


if not any(isinstance(f, _NvrxFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _NvrxFinder())
quiet_fallback_warnings()  # Megatron-Core's TE / apex import warnings -> one run-log line
