"""Checkpoint conversion workflows behind ``tools/convert_checkpoint.py``.

- `hf_to_mcore`: Hugging Face safetensors -> Megatron-Core distributed checkpoint written under
  a TP / PP / EP layout (it reloads under any other layout).
- `mcore_to_hf`: distributed checkpoint -> sharded safetensors + index + config/tokenizer files,
  through the same `export_hf_weights` stream the rollout weight sync uses.

Both run as one process per rank: under torchrun (``WORLD_SIZE`` set) they use the launcher's
ranks; otherwise `launch` starts the needed local processes itself. Inputs are validated in the
launching process first (config, architecture, tensor names and shapes, output directory), so
bad input fails fast with one line and nothing written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_gspo.convert import get_adapter
from megatron_gspo.convert.base import ConversionError
from megatron_gspo.convert.hf_io import (
    HFCheckpointReader,
    read_config,
    save_hf_checkpoint,
    validate_hf_checkpoint,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """'fp32' | 'bf16' | 'fp16' | None -> torch dtype."""
    if name is None:
        return None
    if name not in DTYPES:
        raise ConversionError(f"unknown dtype '{name}' (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


def conversion_world_size(tp: int, pp: int, ep: int) -> int:
    """Ranks needed to hold one copy of the model under (tp, pp, ep) with expert-TP 1."""
    for n, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if v < 1:
            raise ConversionError(f"--{n} must be >= 1, got {v}")
    return pp * math.lcm(tp, ep)


def _layout(tp: int, pp: int, ep: int, moe: bool):
    """Layout for conversion; MoE with TP needs sequence parallelism to be built."""
    from megatron_gspo.megatron.parallel import ParallelLayout

    return ParallelLayout(
        tensor=tp,
        pipeline=pp,
        expert=ep,
        expert_tensor=1 if ep > 1 else None,
        sequence_parallel=moe and tp > 1,
    )


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def check_hf_to_mcore(hf_dir: str, out: str, force: bool) -> dict:
    """Validate inputs of `hf_to_mcore` without touching torch.distributed; returns the config."""
    if Path(out).exists() and not force:
        raise ConversionError(f"output directory {out} exists (pass --force to overwrite)")
    adapter = get_adapter(read_config(hf_dir))
    reader = HFCheckpointReader(hf_dir)
    validate_hf_checkpoint(reader, adapter, adapter.dims(reader.config))
    return reader.config


def hf_to_mcore(
    hf_dir: str,
    out: str,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dtype: torch.dtype = torch.float32,
    force: bool = False,
    progress: bool = True,
) -> None:
    """Per-rank body: build this rank's shards, fill them from HF, save a dist checkpoint.

    Args:
        hf_dir: HF model directory (config.json + safetensors).
        out: checkpoint directory to create.
        tp, pp, ep: layout written.
        dtype: parameter dtype of the checkpoint.
        force: replace `out` if it exists.
        progress: show a progress bar on rank 0.
    """
    from megatron_gspo.megatron import checkpoint_io as cio
    from megatron_gspo.megatron.parallel import initialize, shutdown

    reader = HFCheckpointReader(hf_dir)
    cfg = cio.normalize_hf_config(reader.config)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    layout = _layout(tp, pp, ep, dims.num_experts > 0)
    initialize(layout, hf_config=cfg)
    try:
        models = cio.build_rank_models(
            cfg,
            params_dtype=dtype,
            sequence_parallel=layout.sequence_parallel,
            perform_initialization=False,  # every weight is overwritten
        )
        cio.load_hf_weights(models, reader, adapter, dims, progress=progress and _is_rank0())
        meta = {
            "architecture": adapter.architectures[0],
            "dtype": str(dtype).removeprefix("torch."),
            "written_layout": {"tp": tp, "pp": pp, "ep": ep},
            "source": str(Path(hf_dir).resolve()),
        }
        cio.save_checkpoint(models, out, metadata=meta, hf_side_files=hf_dir, force=force)
    finally:
        shutdown()


def check_mcore_to_hf(ckpt: str, hf_config_dir: str | None, out: str, force: bool) -> str:
    """Validate inputs of `mcore_to_hf`; returns the directory the HF config is read from."""
    from megatron_gspo.megatron.checkpoint_io import HF_SIDE_DIR, read_checkpoint_metadata

    if Path(out).exists() and not force:
        raise ConversionError(f"output directory {out} exists (pass --force to overwrite)")
    read_checkpoint_metadata(ckpt)
    cfg_dir = hf_config_dir or str(Path(ckpt) / HF_SIDE_DIR)
    get_adapter(read_config(cfg_dir))
    return cfg_dir


def mcore_to_hf(
    ckpt: str,
    hf_config_dir: str,
    out: str,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    force: bool = False,
    progress: bool = True,
) -> None:
    """Per-rank body: load the dist checkpoint under (tp, pp, ep), stream HF tensors, rank 0
    writes sharded safetensors (one shard in memory at a time).

    Args:
        ckpt: checkpoint written by `hf_to_mcore` or the learner.
        hf_config_dir: directory with config.json (+ tokenizer files, copied to `out`).
        out: HF directory to create.
        tp, pp, ep: layout to load under (1/1/1 fits models that fit one process).
        dtype: output dtype (None: the checkpoint's).
        max_shard_bytes: safetensors shard size bound.
        force: replace `out` if it exists.
        progress: progress bar on rank 0.
    """
    from megatron_gspo.megatron import checkpoint_io as cio
    from megatron_gspo.megatron.export import export_hf_weights
    from megatron_gspo.megatron.parallel import initialize, shutdown

    meta = cio.read_checkpoint_metadata(ckpt)
    cfg = cio.normalize_hf_config(read_config(hf_config_dir))
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    params_dtype = getattr(torch, str(meta.get("dtype", "float32")), None)
    if params_dtype not in DTYPES.values():
        raise ConversionError(f"{ckpt}: unknown checkpoint dtype {meta.get('dtype')!r}")
    out_dtype = dtype or params_dtype
    largest = (
        max(math.prod(s) for pm in adapter.param_maps(dims) for s in pm.shapes)
        * torch.empty((), dtype=out_dtype).element_size()
    )
    layout = _layout(tp, pp, ep, dims.num_experts > 0)
    initialize(layout, hf_config=cfg)
    try:
        models = cio.build_rank_models(
            cfg,
            params_dtype=params_dtype,
            sequence_parallel=layout.sequence_parallel,
            perform_initialization=False,  # every weight is overwritten
        )
        cio.load_checkpoint(models, ckpt)
        buckets = export_hf_weights(
            models, cfg, bucket_bytes=max(largest, min(max_shard_bytes, 256 * 2**20)), dtype=dtype
        )
        items = ((n, t) for b in buckets for n, t in b)
        if _is_rank0():
            if progress:
                from tqdm import tqdm

                items = tqdm(items, desc="mcore-to-hf", unit=" tensors")
            save_hf_checkpoint(
                items,
                out,
                side_files_from=hf_config_dir,
                max_shard_bytes=max_shard_bytes,
                dtype=out_dtype,
                force=force,
            )
        else:
            for _ in items:  # take part in the collectives
                pass
    finally:
        shutdown()


def _child(local_rank: int, world: int, port: int, fn: Callable, kwargs: dict) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    fn(**kwargs)


def launch(fn: Callable, world: int, **kwargs) -> None:
    """Run `fn(**kwargs)` on `world` ranks: in-process under torchrun or for one rank, else in
    freshly spawned local processes (CPU: gloo; GPU: one device per process).

    Raises:
        ConversionError with the failing rank's last error line.
    """
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is not None:
        if int(env_world) % world:
            raise ConversionError(
                f"WORLD_SIZE={env_world} is not a multiple of the {world} ranks this layout needs"
            )
        fn(**kwargs)
        return
    if world == 1:
        fn(**kwargs)
        return
    import torch.multiprocessing as mp

    from megatron_gspo.megatron.parallel import free_port

    try:
        mp.start_processes(
            _child, args=(world, free_port(), fn, kwargs), nprocs=world, start_method="spawn"
        )
    except mp.ProcessRaisedException as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise ConversionError(lines[-1] if lines else "a conversion rank failed") from None
    except mp.ProcessExitedException as e:
        raise ConversionError(f"a conversion rank died: {e}") from None
