"""Parity of one model family under TP / PP / EP, run by tests/convert/test_family_parity.py.

For each layout named in `layouts` (1 rank: "single"; 2 ranks: "tp2", "pp2", "ep2"): HF
weights -> live Megatron-Core model; logits vs transformers' (max abs error recorded);
exported buckets == the HF tensors bit for bit (HF -> Megatron -> HF); a checkpoint saved
under the layout ("tp2", "ep2") or loaded from one saved before ("single" loads them).
Each rank writes `parity.<tag>.rank<r>.json` = {layout: max abs logits error, ...}.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.convert._convert_worker import (  # noqa: E402
    _check_export,
    _check_stage_export,
    _forward_logits,
)


def _layout(name: str, sp: bool, expert_bias: bool):
    from megatron_gspo.megatron.parallel import ParallelLayout

    return {
        "single": ParallelLayout(),
        # (experts with biases, gpt-oss: Megatron-Core needs expert-TP 1)
        "tp2": ParallelLayout(tensor=2, sequence_parallel=sp, expert=2 if expert_bias else 1,
                              expert_tensor=1 if expert_bias else None),
        "pp2": ParallelLayout(pipeline=2),
        "ep2": ParallelLayout(expert=2, expert_tensor=1),
    }[name]


def _err(models, ref) -> float | None:
    got = _forward_logits(models, ref["tokens"])
    if got is None:
        return None
    want = ref["logits"]
    return float((got[..., : want.shape[-1]] - want).abs().max())


def _check_groups(models, cfg, adapter, dims, what) -> int:
    """With buckets smaller than any pair, the adapter's bucket groups (DeepSeek-V3:
    q_a_proj + kv_a_proj_with_mqa of a layer) still share one bucket; returns groups seen."""
    from megatron_gspo.megatron.io.weight_export import export_hf_weights

    where: dict = {}
    for b, bucket in enumerate(export_hf_weights(models, cfg, bucket_bytes=1024)):
        for name, _ in bucket:
            group = adapter.bucket_group(name, dims)
            if group is not None:
                where.setdefault(group[0], set()).add(b)
    split = sorted(k for k, v in where.items() if len(v) > 1)
    assert not split, f"{what}: bucket groups split over buckets: {split}"
    return len(where)


def run(hf_dir: str, refs_path: str, work: str, layouts: list[str], tag: str) -> None:
    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.parallel import initialize, shutdown

    ref = torch.load(refs_path)
    work = Path(work)
    reader = HFCheckpointReader(hf_dir)
    cfg = cio.normalize_hf_config(reader.config)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    moe = dims.num_experts > 0
    import math

    # the largest HF tensor (embedding rows, or gpt-oss's [E, ...] expert tensors) -> several
    bucket = 4 * max(math.prod(s) for pm in adapter.param_maps(dims) for s in pm.shapes)
    out: dict = {}
    try:
        for name in layouts:
            if name == "ep2" and not moe:
                continue
            # (SP also for gated delta-net hybrids: Qwen3-Next / Qwen3.5 refuse TP without it)
            sp = moe or bool(cfg.get("linear_num_key_heads"))
            layout = _layout(name, sp, cfg.get("architectures") == ["GptOssForCausalLM"])
            initialize(layout, hf_config=cfg)
            build = partial(cio.build_rank_models, cfg, perform_initialization=False,
                            sequence_parallel=layout.sequence_parallel)
            models = build()
            cio.load_hf_weights(models, reader, adapter, dims)
            out[name] = _err(models, ref)
            _check_export(models, cfg, reader, bucket, f"{name} export")
            out[f"{name}_bucket_groups"] = _check_groups(models, cfg, adapter, dims, name)
            if layout.pipeline > 1:
                _check_stage_export(models, cfg, reader, bucket, f"{name} per-stage export")
            if name in ("tp2", "ep2"):
                cio.save_checkpoint(models, work / f"ckpt_{name}", metadata={"dtype": "float32"},
                                    hf_side_files=hf_dir, force=True)
            if name == "single":
                for saved in ("tp2", "ep2"):
                    if (work / f"ckpt_{saved}").is_dir():
                        models = build()
                        cio.load_checkpoint(models, work / f"ckpt_{saved}")
                        out[f"single_from_{saved}_ckpt"] = _err(models, ref)
    finally:
        rank = dist.get_rank() if dist.is_initialized() else 0
        (work / f"parity.{tag}.rank{rank}.json").write_text(json.dumps(out))
        shutdown()


if __name__ == "__main__":
    from megatron_gspo.megatron.io.conversion import launch

    args = json.loads(sys.argv[1])
    launch(run, args.pop("world"), **args)
