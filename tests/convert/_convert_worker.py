"""Multi-rank checks of conversion under TP / PP / EP, run by tests/convert/test_layouts.py.

Started as 4 local processes (gloo, CPU). For every architecture:
  phase 1 (TP1 PP1): HF -> live model, logits == transformers', save checkpoint A,
                     export buckets == HF tensors bit for bit (bucket bound respected).
  phase 2 (TP2 PP2, EP2 for MoE): HF -> live model logits; save checkpoint B; load A under this
                     layout -> logits; export (gathered) == HF tensors.
  phase 3 (TP1 PP1): load B -> logits.
Any mismatch raises AssertionError on the rank that sees it.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

REL_TOL = 1e-4


def _forward_logits(models, tokens):
    """Full-vocab logits [B, T, V_pad] on last-stage ranks, None elsewhere (pipeline forward)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, t = tokens.shape
    for m in models:
        m.eval()
    pos = torch.arange(t).unsqueeze(0).expand(b, -1)

    def step(_it, model):
        out = model(tokens, pos, attention_mask=None)

        def loss_func(output, non_loss_data=False):
            return output

        return out, loss_func

    with torch.no_grad():
        res = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([None]),
            model=models,
            num_microbatches=1,
            seq_length=t,
            micro_batch_size=b,
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not ps.is_pipeline_last_stage():
        return None
    logits = res[0]  # [B, T, V_pad / tp]
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits


def _check_logits(models, ref, what):
    got = _forward_logits(models, ref["tokens"])
    if got is None:
        return
    want = ref["logits"]
    err = (got[..., : want.shape[-1]] - want).abs().max() / want.abs().max()
    assert err <= REL_TOL, f"{what}: logits differ from transformers, rel err {err:.3e}"


def _check_export(models, cfg, reader, bucket_bytes, what, save_to=None):
    from megatron_gspo.megatron.io.weight_export import export_hf_weights

    seen = {}
    for bucket in export_hf_weights(models, cfg, bucket_bytes=bucket_bytes):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= bucket_bytes, f"{what}: bucket of {size} B > bound {bucket_bytes}"
        for name, t in bucket:
            assert name not in seen, f"{what}: {name} exported twice"
            seen[name] = t.clone()
    assert sorted(seen) == sorted(reader.keys()), f"{what}: exported names differ from HF"
    for name, t in seen.items():
        ref = reader.get(name)
        assert t.dtype == ref.dtype and torch.equal(t, ref), f"{what}: {name} differs"
    if save_to is not None and dist.get_rank() == 0:
        torch.save(seen, save_to)


def _check_stage_export(models, cfg, reader, bucket_bytes, what):
    """gather_pipeline=False: each stage yields its own tensors; stages partition the model."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.megatron.io.weight_export import export_hf_weights

    buckets = export_hf_weights(models, cfg, bucket_bytes=bucket_bytes, gather_pipeline=False)
    mine = [n for b in buckets for n, _ in b]
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
    flat = [n for s in stages for n in s]
    assert len(flat) == len(set(flat)) and sorted(flat) == sorted(reader.keys()), what


def run(hf_dirs: dict, refs_path: str, work: str) -> None:
    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.parallel import ParallelLayout, initialize, shutdown

    refs = torch.load(refs_path)
    work = Path(work)
    try:
        for arch, hf_dir in hf_dirs.items():
            reader = HFCheckpointReader(hf_dir)
            cfg = cio.normalize_hf_config(reader.config)
            adapter = get_adapter(cfg)
            dims = adapter.dims(cfg)
            moe = dims.num_experts > 0
            ref = refs[arch]
            small = ParallelLayout()
            big = ParallelLayout(
                tensor=2,
                pipeline=2,
                expert=2 if moe else 1,
                expert_tensor=1 if moe else None,
                sequence_parallel=moe,
            )
            build_small = partial(cio.build_rank_models, cfg, perform_initialization=False)
            build_big = partial(
                cio.build_rank_models, cfg, sequence_parallel=moe, perform_initialization=False
            )
            # bound = largest tensor (embedding rows) -> several buckets
            bucket = dims.vocab_size * dims.hidden_size * 4

            initialize(small, hf_config=cfg)
            models = build_small()
            cio.load_hf_weights(models, reader, adapter, dims)
            _check_logits(models, ref, f"{arch} tp1 from HF")
            cio.save_checkpoint(
                models, work / f"{arch}_A", metadata={"dtype": "float32"}, hf_side_files=hf_dir
            )
            _check_export(models, cfg, reader, bucket, f"{arch} tp1 export")

            initialize(big, hf_config=cfg)
            models = build_big()
            cio.load_hf_weights(models, reader, adapter, dims)
            _check_logits(models, ref, f"{arch} {big} from HF")
            cio.save_checkpoint(
                models, work / f"{arch}_B", metadata={"dtype": "float32"}, hf_side_files=hf_dir
            )
            models = build_big()
            cio.load_checkpoint(models, work / f"{arch}_A")
            _check_logits(models, ref, f"{arch} {big} from tp1 checkpoint")
            _check_export(
                models,
                cfg,
                reader,
                bucket,
                f"{arch} {big} export",
                save_to=work / f"{arch}_export.pt",
            )
            _check_stage_export(models, cfg, reader, bucket, f"{arch} {big} per-stage export")

            initialize(small, hf_config=cfg)
            models = build_small()
            cio.load_checkpoint(models, work / f"{arch}_B")
            _check_logits(models, ref, f"{arch} tp1 from {big} checkpoint")
    finally:
        shutdown()


if __name__ == "__main__":
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_gspo.megatron.io.conversion import launch

    args = json.loads(sys.argv[1])
    launch(run, 4, **args)
