"""`convert lora-to-peft`: a LoRA run checkpoint (adapters only, `megatron.lora.io`) plus its
Hugging Face base -> a PEFT adapter directory and, optionally, a merged Hugging Face model.

One process: the base is built at TP = PP = EP = 1 on the CPU (or the current GPU), its weights
read from the base directory, the adapters loaded from the checkpoint (resharded from whatever
layout trained them), then
  - the adapters are gathered and written with PEFT's names (`lora_io.write_peft_adapter`);
  - the merged model (base + scale * B A in every adapted layer) streams through the same
    `export_hf_weights` as the weight sync into sharded safetensors with the base's config and
    tokenizer files.
Routed-expert adapters go to peft's `target_parameters` on transformers 5's fused 3-D expert
tensors, shared experts and dense MLP layers of an MoE model by module path (peft >= 0.22);
what peft cannot load (those under an older peft, gpt-oss experts, expert adapters with
dropout) is refused before any weight is read (`lora_io.peft_refusal`): export --merged.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from megatron_gspo.convert.param_map import ConversionError


def check_lora_to_peft(ckpt: str, base: str | None, out: str, merged: str | None,
                       force: bool) -> dict:
    """Validate the inputs without torch.distributed; returns `lora_to_peft`'s arguments.

    Refused in one line: a checkpoint without lora.json; a `base` whose weights are not the
    base lora.json records (`lora_io.base_mismatch`); an output that is, contains or lies
    inside the checkpoint, its run directory or the base, or that overlaps the other output.
    """
    from megatron_gspo.convert.guards import check_out_disjoint
    from megatron_gspo.convert.hf_io import read_config
    from megatron_gspo.convert.sources import resolve_checkpoint
    from megatron_gspo.megatron.lora.io import base_mismatch, peft_refusal, read_adapter_info

    src = resolve_checkpoint(ckpt)
    info = read_adapter_info(src.dist_dir)
    if info is None:
        raise ConversionError(f"--ckpt {ckpt}: not a LoRA checkpoint (no lora.json in "
                              f"{src.dist_dir}); use `convert mcore-to-hf`")
    base_flag = "--base" if base else "the base named in lora.json"
    base = base or info.get("base")
    if not base or not (Path(base) / "config.json").is_file():
        raise ConversionError(f"--ckpt {ckpt}: its base {base!r} is not a Hugging Face model "
                              "directory reachable from here; pass --base DIR")
    problem = base_mismatch(info, base)
    if problem:
        raise ConversionError(f"{base_flag} {base}: {problem} (lora.json of {src.root}); the "
                              "adapters only fit the base they were trained on")
    inputs = {**src.inputs(ckpt), base_flag: base}
    for path, flag in ((out, "--out"), (merged, "--merged")):
        if path is not None:
            check_out_disjoint(path, inputs, out_flag=flag)
    if out is not None and merged is not None:
        check_out_disjoint(merged, {"the other output --out": out}, out_flag="--merged")
    for path, flag in ((out, "--out"), (merged, "--merged")):
        if path is not None and Path(path).exists() and not force:
            raise ConversionError(f"{flag} {path} exists (pass --force to overwrite)")
    refusal = peft_refusal(info["targets"], read_config(base), float(info.get("dropout") or 0))
    if refusal and out is not None:
        raise ConversionError(f"--out {out}: {refusal}")
    return {"ckpt": str(src.dist_dir), "base": str(base), "info": info,
            "hf_config": read_config(base)}


def lora_to_peft(ckpt: str, base: str, info: dict, hf_config: dict, out: str | None,
                 merged: str | None = None, dtype: torch.dtype | None = None,
                 force: bool = False, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write the PEFT adapter (`out`) and/or the merged model (`merged`)."""
    from megatron.core import dist_checkpointing

    from megatron_gspo.convert.hf_io import (HFCheckpointReader, commit_output_dir,
                                             prepare_output_dir, save_hf_checkpoint)
    from megatron_gspo.convert.registry import get_adapter
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.lora import adapters as lora
    from megatron_gspo.megatron.models import shards as weights
    from megatron_gspo.megatron.io.weight_export import export_hf_weights
    from megatron_gspo.megatron.lora.io import write_peft_adapter
    from megatron_gspo.megatron.parallel import ParallelLayout, initialize, shutdown

    cfg = cio.normalize_hf_config(hf_config)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    settings = lora.LoraSettings(rank=int(info["rank"]), alpha=float(info["alpha"]),
                                 dropout=float(info["dropout"]), targets=tuple(info["targets"]))
    initialize(ParallelLayout(), hf_config=cfg)
    tmp = None  # the adapter's temp dir until it is moved into place
    try:
        models = cio.build_rank_models(cfg, params_dtype=torch.float32,
                                       perform_initialization=False)
        reader = HFCheckpointReader(base)
        try:
            with torch.no_grad():
                cio.load_hf_weights(models, reader, adapter, dims)
        finally:
            reader.close()
        lora.attach(models, settings)
        with torch.no_grad():
            loaded = dist_checkpointing.load({"lora": lora.sharded_state_dict(models)}, ckpt)
        lora.load_sharded(models, loaded["lora"])
        if out is not None:  # into a temp dir beside `out`, moved into place at the end
            tmp = prepare_output_dir(out, force)
            full = {k: v for k, v in weights.gather_full(models, dims.tie_embeddings).items()
                    if lora.is_adapter_name(k)}
            write_peft_adapter(tmp, full, dims, settings, base, dtype or torch.float32,
                               arch=(cfg.get("architectures") or [None])[0])
        if merged is not None:
            buckets = export_hf_weights(models, cfg, bucket_bytes=256 * 2**20, dtype=dtype)
            save_hf_checkpoint(((n, t) for b in buckets for n, t in b), merged,
                               side_files_from=base, max_shard_bytes=max_shard_bytes,
                               dtype=dtype or torch.float32, force=force)
            print(f"convert_checkpoint: wrote merged model {merged}", file=sys.stderr)
        if tmp is not None:
            commit_output_dir(tmp, out)
            tmp = None
            print(f"convert_checkpoint: wrote PEFT adapter {out}", file=sys.stderr)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        shutdown()
