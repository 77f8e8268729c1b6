"""Run checkpoints written by the learner under several layouts, for tests/convert/
test_run_checkpoints.py (4 local processes, gloo, CPU).

For each case: a Learner under the case's layout takes the tiny HF model's weights, takes one
GSPO optimizer step (so the weights differ from the HF model's), is saved through
`Checkpointer.save` (what the trainer calls), and rank 0 writes the learner's response
log-probs of a fixed batch under the saved weights to `<work>/<case>/logprobs.pt`.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

CASES = {
    # name: (architecture, layout kwargs, distributed optimizer)
    "tied_tp2_pp2": ("Qwen2ForCausalLM", {"tensor": 2, "pipeline": 2}, False),
    "moe_pp2_ep2": ("Qwen3MoeForCausalLM", {"pipeline": 2, "expert": 2}, False),
    "llama_pp2_vpp2_dp2": ("LlamaForCausalLM", {"pipeline": 2, "virtual_pipeline": 2}, True),
}


def samples(n: int = 6, seed: int = 0):
    """A fixed batch of random token sequences with advantages."""
    from megatron_gspo.data.sample import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(1, 100) for _ in range(rng.randint(2, 5))]
        r = [rng.randrange(1, 100) for _ in range(rng.randint(3, 8))]
        out.append(Sample(prompt_ids=p, response_ids=r, index=i, advantage=rng.uniform(-1, 1)))
    return out


def run(hf_dirs: dict, work: str) -> None:
    from megatron_gspo.runtime.run_checkpoint import Checkpointer
    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader, read_config
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.learner import Learner
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.parallel import ParallelLayout, shutdown

    batch = samples()
    try:
        for case, (arch, layout, distopt) in CASES.items():
            cfg = cio.normalize_hf_config(read_config(hf_dirs[arch]))
            learner = Learner(
                cfg,
                layout=ParallelLayout(**layout),
                optim=OptimSettings(lr=1e-2, use_distributed_optimizer=distopt),
                use_te=False,
                seed=3,
            )
            adapter = get_adapter(cfg)
            dims = adapter.dims(cfg)
            cio.load_hf_weights(learner.chunks, HFCheckpointReader(hf_dirs[arch]), adapter, dims)
            learner._refresh_main_params()
            old = learner.forward_logprobs(batch)
            learner.train_step(batch, old)
            run_dir = Path(work) / case
            Checkpointer(run_dir / "checkpoints").save(1, learner, {"step": 1})
            lps = learner.forward_logprobs(batch)
            if torch.distributed.get_rank() == 0:  # the same lists on every rank
                torch.save({"logprobs": lps, "before": old}, run_dir / "logprobs.pt")
    finally:
        shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_gspo.megatron.io.conversion import launch

    launch(run, 4, **json.loads(sys.argv[1]))
