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
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_gspo.convert import get_adapter
from megatron_gspo.convert.param_map import ConversionError, num_routed_experts
from megatron_gspo.convert.guards import (
    check_config_against_shapes,
    check_out_disjoint,
    checkpoint_shapes,
    compare_configs,
    model_fields,
)
from megatron_gspo.convert.mtp import declared_mtp_layers
from megatron_gspo.convert.hf_io import (
    HFCheckpointReader,
    commit_output_dir,
    read_config,
    save_hf_checkpoint,
    validate_hf_checkpoint,
)
from megatron_gspo.convert.sources import (other_model, resolve_checkpoint, tokenizer_fingerprint,
                                         weights_fingerprint)
from megatron_gspo.convert.tempdirs import make_temp_dir

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


_FLAGS = {"tensor": "--tp", "pipeline": "--pp", "expert": "--ep"}


def check_conversion_layout(tp: int, pp: int, ep: int, hf_config: dict) -> None:
    """The (tp, pp, ep) layout fits the model (heads, layers, experts, ...), checked before any
    process starts: ConversionError naming the convert flags (not the train fields)."""
    import re

    from megatron_gspo.megatron.parallel import ParallelLayoutError, check_layout

    cfg = dict(hf_config)
    try:
        check_layout(_layout(tp, pp, ep, bool(num_routed_experts(cfg))),
                     conversion_world_size(tp, pp, ep), cfg)
    except ParallelLayoutError as e:
        msg = re.sub(r"parallel\.(tensor|pipeline|expert)\b", lambda m: _FLAGS[m[1]], str(e))
        msg = msg.replace("pipeline*virtual_pipeline = ", "--pp ")
        raise ConversionError(f"--tp {tp} --pp {pp} --ep {ep}: {msg}") from None


def check_hf_to_mcore(hf_dir: str, out: str, force: bool,
                      layout: tuple[int, int, int] = (1, 1, 1)) -> dict:
    """Validate inputs of `hf_to_mcore` without touching torch.distributed (the output, the
    config, the (tp, pp, ep) `layout` against it, then the tensors); returns the config."""
    check_out_disjoint(out, {"--hf": hf_dir})
    if Path(out).exists() and not force:
        raise ConversionError(f"output directory {out} exists (pass --force to overwrite)")
    config = read_config(hf_dir)
    adapter = get_adapter(config)
    check_conversion_layout(*layout, config)
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
    from megatron_gspo.megatron.io import dist_checkpoint as cio
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
            mtp=declared_mtp_layers(cfg) > 0,  # the reader counts the MTP layers present
        )
        cio.load_hf_weights(models, reader, adapter, dims, progress=progress and _is_rank0())
        meta = {
            "architecture": adapter.architectures[0],
            "dtype": str(dtype).removeprefix("torch."),
            "written_layout": {"tp": tp, "pp": pp, "ep": ep},
            "source": str(Path(hf_dir).resolve()),
            "source_fingerprint": weights_fingerprint(hf_dir),
            "tokenizer_fingerprint": tokenizer_fingerprint(hf_dir),
        }
        # written inside an owned temp dir (removed by a later run if this one is killed),
        # then moved into place (replacing `out` when forced; the launcher checked --force)
        work = _shared_temp_dir(Path(out))
        try:
            cio.save_checkpoint(models, work / "ckpt", metadata=meta, hf_side_files=hf_dir)
            if _is_rank0():
                commit_output_dir(work / "ckpt", out)
        finally:
            if _is_rank0():
                shutil.rmtree(work, ignore_errors=True)
    finally:
        shutdown()


def _shared_temp_dir(target: Path) -> Path:
    """An owned temp dir next to `target`, created by rank 0 and named to every rank."""
    import torch.distributed as dist

    obj = [str(make_temp_dir(target)) if _is_rank0() else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(obj, src=0)
    return Path(obj[0])


def check_mcore_to_hf(ckpt: str, hf_config_dir: str | None, out: str, force: bool,
                      layout: tuple[int, int, int] = (1, 1, 1)) -> dict:
    """Validate inputs of `mcore_to_hf` without touching torch.distributed.

    Resolves ``--ckpt`` (converted or run checkpoint, see `convert.sources`), picks the config
    (``--hf-config``, else the one stored with the checkpoint, else the run's ``model.path``),
    and refuses a config that differs from the stored one or from the tensor shapes, and an
    output directory that overlaps an input.

    Returns:
        keyword arguments of `mcore_to_hf` (ckpt, hf_config, side_dir, write_config,
        ckpt_dtype).
    """
    src = resolve_checkpoint(ckpt)
    stored_name = f"the config stored with {src.root}"
    if hf_config_dir is not None:
        cfg, cfg_name, side = read_config(hf_config_dir), f"--hf-config {hf_config_dir}", \
            Path(hf_config_dir)
    elif src.stored_config is not None:
        cfg, cfg_name, side = src.stored_config, stored_name, src.side_dir
    elif src.side_dir is not None:
        cfg, side = read_config(src.side_dir), src.side_dir
        cfg_name = f"{side / 'config.json'} (model.path of the run)"
        src.notes.append(f"no config stored with {src.root}; using {cfg_name}")
    else:
        raise ConversionError(
            f"{ckpt}: no Hugging Face config stored with the checkpoint and none found through "
            "the run's config.yaml; pass --hf-config DIR"
        )
    check_out_disjoint(out, {**src.inputs(ckpt), "--hf-config": hf_config_dir,
                             "model.path of the run": side})
    if Path(out).exists() and not force:
        raise ConversionError(f"output directory {out} exists (pass --force to overwrite)")
    adapter = get_adapter(cfg)
    from megatron_gspo.megatron.io.dist_checkpoint import normalize_hf_config

    adapter.dims(normalize_hf_config(cfg))
    check_conversion_layout(*layout, cfg)
    if src.stored_config is not None and cfg is not src.stored_config:
        compare_configs(cfg, src.stored_config, cfg_name, stored_name)
    if hf_config_dir is not None:  # the same model: context, tokenizer, weights it started from
        why = other_model(hf_config_dir, cfg, src)
        if why is not None:
            raise ConversionError(f"{why}; pass the directory of that model (or one with its "
                                  "config.json and tokenizer files only)")
    shapes = checkpoint_shapes(src.dist_dir)
    check_config_against_shapes(cfg, shapes, cfg_name, str(src.root))
    write_config = None  # the side dir's config.json is copied when it describes this model
    if side is None or not (side / "config.json").is_file() or (
        model_fields(read_config(side)) != model_fields(cfg)
    ) or declared_mtp_layers(read_config(side)) != declared_mtp_layers(cfg):  # MTP added
        write_config = cfg
    if side is None:
        src.notes.append("no tokenizer files copied (the run's model.path is not reachable "
                         "from here); pass --hf-config DIR to copy them")
    emb = shapes.get("embedding.word_embeddings.weight")
    dtype = src.dtype or (emb[1] if emb else "float32")
    for note in src.notes:
        print(f"convert_checkpoint: {note}", file=sys.stderr)
    return {
        "ckpt": str(src.dist_dir),
        "hf_config": cfg,
        "side_dir": None if side is None else str(side),
        "write_config": write_config,
        "ckpt_dtype": dtype,
    }


def mcore_to_hf(
    ckpt: str,
    hf_config: dict,
    out: str,
    *,
    side_dir: str | None = None,
    write_config: dict | None = None,
    ckpt_dtype: str = "float32",
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
        ckpt: torch_dist folder written by `hf_to_mcore` or the learner (model/ of a run
            checkpoint); see `check_mcore_to_hf`, which resolves all of these.
        hf_config: the model's parsed config.json.
        out: HF directory to create.
        side_dir: directory whose config / tokenizer files are copied to `out` (None: none).
        write_config: written as config.json instead of the copied one (None: keep it).
        ckpt_dtype: parameter dtype of the checkpoint ("float32", "bfloat16", "float16").
        tp, pp, ep: layout to load under (1/1/1 fits models that fit one process).
        dtype: output dtype (None: the checkpoint's).
        max_shard_bytes: safetensors shard size bound.
        force: replace `out` if it exists.
        progress: progress bar on rank 0.
    """
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.io.weight_export import export_hf_weights
    from megatron_gspo.megatron.parallel import initialize, shutdown

    cfg = cio.normalize_hf_config(hf_config)
    adapter = get_adapter(cfg)
    dims = adapter.dims(cfg)
    params_dtype = getattr(torch, str(ckpt_dtype), None)
    if params_dtype not in DTYPES.values():
        raise ConversionError(f"{ckpt}: unknown checkpoint dtype {ckpt_dtype!r}")
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
            mtp=cio.checkpoint_has_mtp(ckpt),
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
                side_files_from=side_dir,
                max_shard_bytes=max_shard_bytes,
                dtype=out_dtype,
                force=force,
                config=write_config,
            )
        else:
            for _ in items:  # take part in the collectives
                pass
    finally:
        shutdown()


def _body(fn: Callable, kwargs: dict, rank: int = 0) -> None:
    """`fn(**kwargs)`, a full disk under its output as a one-line ConversionError.

    A failed save reports every rank's write error on rank 0 (the coordinator) only; another
    rank whose error says nothing of a full disk waits a moment, so that the launcher, which
    reports the first process to fail, reports rank 0's error."""
    from megatron_gspo.runtime.diskfull import disk_full

    try:
        fn(**kwargs)
    except BaseException as e:  # (torch's CheckpointException is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        msg = disk_full(e, kwargs.get("out") or kwargs.get("merged") or ".")
        if msg is not None:
            raise ConversionError(msg) from None
        if rank != 0:
            import time

            time.sleep(3.0)
        if not isinstance(e, Exception):  # torch's spawn reports Exceptions only
            raise RuntimeError(f"{type(e).__name__}: {e}") from e
        raise


def _child(local_rank: int, world: int, port: int, fn: Callable, kwargs: dict) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    _body(fn, kwargs, local_rank)


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
        _body(fn, kwargs)
        return
    if world == 1:
        _body(fn, kwargs)
        return
    import torch.multiprocessing as mp

    from megatron_gspo.megatron.parallel import free_port

    try:
        mp.start_processes(
            _child, args=(world, free_port(), fn, kwargs), nprocs=world, start_method="spawn"
        )
    except mp.ProcessRaisedException as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else "a conversion rank failed"
        raise ConversionError(last.removeprefix(f"{ConversionError.__module__}."
                                                f"{ConversionError.__name__}: ")) from None
    except mp.ProcessExitedException as e:
        raise ConversionError(f"a conversion rank died: {e}") from None
