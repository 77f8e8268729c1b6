"""A LoRA run checkpoint of a tiny HF model, for tests/convert/test_lora_export_guards.py (one
process, CPU): a LoRA learner on the model's weights, saved through `Checkpointer.save` as the
trainer does (lora.json names the base and records its fingerprint)."""

from __future__ import annotations

import sys
from pathlib import Path


def main(base: str, run_dir: str, targets: str = "qkv,proj") -> None:
    """`targets`: comma-separated LoRA targets; other than the default, the B factors are
    random (seeded) so the saved adapters are far from the base."""
    import torch

    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader, read_config
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.learner import Learner
    from megatron_gspo.megatron.lora.adapters import LoraSettings
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.parallel import shutdown
    from megatron_gspo.runtime.run_checkpoint import Checkpointer

    cfg = cio.normalize_hf_config(read_config(base))
    learner = Learner(cfg, optim=OptimSettings(lr=1e-2), use_te=False, seed=3,
                      lora=LoraSettings(rank=4, alpha=8.0, targets=tuple(targets.split(","))))
    try:
        adapter = get_adapter(cfg)
        with torch.no_grad():
            cio.load_hf_weights(learner.chunks, HFCheckpointReader(base), adapter,
                                adapter.dims(cfg))
        if targets != "qkv,proj":
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for n, p in learner.chunks[0].named_parameters():
                    if n.endswith(".lora_b"):
                        p.copy_(0.3 * torch.randn(p.shape, generator=g))
        learner._refresh_main_params()
        learner.lora_base = learner.model_source = base
        Checkpointer(Path(run_dir) / "checkpoints").save(1, learner, {"step": 1})
        (Path(run_dir) / "metrics.jsonl").write_text('{"step": 0}\n')
    finally:
        shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(*sys.argv[1:4])
