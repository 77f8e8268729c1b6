"""Megatron logits of the prepared SmolLM2-135M under several layouts, run by
tests/convert/test_smollm2.py as local processes (gloo, CPU).

argv: JSON {"hf_dir", "refs_path", "layouts": [{"tensor": t, "pipeline": p}, ...], "out"}.
For each layout: initialise, build this rank's chunks (fp32, local spec), load the HF weights,
forward the reference tokens, and (last stage, TP rank 0) write the max |diff| against
transformers' fp32 logits, relative to max |logit|, to out/<layout>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def run(hf_dir: str, refs_path: str, layouts: list, out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.parallel import ParallelLayout, initialize, shutdown
    from tests.convert._convert_worker import _forward_logits

    ref = torch.load(refs_path)
    reader = HFCheckpointReader(hf_dir)
    cfg = cio.normalize_hf_config(reader.config)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    try:
        for spec in layouts:
            layout = ParallelLayout(**spec)
            initialize(layout, hf_config=cfg)
            models = cio.build_rank_models(cfg, use_te=False, perform_initialization=False)
            cio.load_hf_weights(models, reader, adapter, dims)
            got = _forward_logits(models, ref["tokens"])
            name = f"tp{layout.tensor}_pp{layout.pipeline}"
            if got is not None and ps.get_tensor_model_parallel_rank() == 0:
                want = ref["logits"]
                diff = (got[..., : want.shape[-1]] - want).abs().max().item()
                rel = diff / want.abs().max().item()
                if ps.get_data_parallel_rank() == 0:
                    Path(out, f"{name}.json").write_text(json.dumps(
                        {"abs": diff, "rel": rel, "padded_vocab": got.shape[-1],
                         "world": dist.get_world_size()}))
            del models
    finally:
        shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_gspo.megatron.io.conversion import launch

    args = json.loads(sys.argv[1])
    world = int(args.pop("world"))
    launch(run, world, **args)
