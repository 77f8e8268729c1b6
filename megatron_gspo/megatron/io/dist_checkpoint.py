"""Hugging Face weights into live Megatron-Core models, and distributed checkpoint save / load.

- `model_param_entries`: each local parameter of a (pipeline stage / virtual chunk of a)
  GPTModel with its canonical global name (global layer index from the layer's
  ``layer_number``, global expert index from the expert-parallel rank) and its ParamMap.
- `load_hf_weights`: fill the local shards of every parameter from a safetensors checkpoint,
  reading only the HF tensors this rank needs (one parameter at a time).
- `save_checkpoint` / `load_checkpoint`: Megatron-Core ``dist_checkpointing`` (torch_dist) of
  the models' sharded state dicts; the checkpoint reshards on load, so it loads under any
  TP / PP / EP layout. The target directory is written under a temporary name and renamed into
  place by rank 0 once every rank has finished.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.convert.param_map import (
    ConversionError,
    ModelDims,
    VOCAB_KINDS,
    ParamMap,
    StateDictAdapter,
    from_te_name,
    to_mcore_tensor,
)
from megatron_gspo.convert.hf_io import HFCheckpointReader, commit_output_dir, copy_side_files
from megatron_gspo.convert.sources import (  # the on-disk format, shared with the converter
    FORMAT,
    HF_SIDE_DIR,
    META_NAME,
)
from megatron_gspo.convert.mtp import without_mtp_copies
from megatron_gspo.convert.sharding import expert_index, layer_index, rename_indices, tp_shard
from megatron_gspo.megatron.compat import canonical_mtp_name



def normalize_hf_config(cfg: Mapping) -> dict:
    """Copy of an HF config with ``num_experts`` set when only ``num_local_experts`` is given
    (transformers >= 5 writes Qwen3-MoE configs that way)."""
    out = dict(cfg)
    if out.get("num_experts") is None and out.get("num_local_experts") is not None:
        out["num_experts"] = out["num_local_experts"]  # (DeepSeek's n_routed_experts is read
        # by `convert.param_map.num_routed_experts` where it matters)
    return out


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


@dataclass
class ParamEntry:
    """One local parameter and where it sits in the global model."""

    local: str
    canonical: str
    param: torch.nn.Parameter
    pm: ParamMap | None  # None: a tied output-layer copy (not exported)


def _ep_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank()


def model_param_entries(
    model: torch.nn.Module, maps: Mapping[str, ParamMap], tied: bool
) -> list[ParamEntry]:
    """Local parameters of one model chunk with canonical global names.

    Args:
        model: GPTModel (wrappers allowed).
        maps: canonical name -> ParamMap (from the adapter).
        tied: embeddings and output layer are shared.
    Returns:
        entries in parameter order; raises ConversionError for a parameter with no mapping.
    """
    model = unwrap(model)
    layer_global = {}
    num_local_experts = {}
    if getattr(model, "decoder", None) is not None:
        for i, layer in enumerate(model.decoder.layers):
            layer_global[i] = layer.layer_number - 1
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is not None:
                num_local_experts[i] = experts.num_local_experts
    out = []
    named = list(model.named_parameters())
    # persistent buffers that are weights of the HF checkpoint (the router's expert bias)
    named += [(n, b) for n, b in model.named_buffers() if n.endswith(_BUFFER_WEIGHTS)]
    for local, p in named:
        if local.endswith((".lora_a", ".lora_b")):
            continue  # LoRA factors (megatron.lora.adapters): exported merged into their weight
        name = canonical_mtp_name(from_te_name(local))
        li = layer_index(name)
        if li is not None:
            name = rename_indices(name, layer=layer_global[li])
            e = expert_index(name)
            if e is not None:
                name = rename_indices(name, expert=e + _ep_rank() * num_local_experts[li])
        elif name.startswith("mtp.") and expert_index(name) is not None and num_local_experts:
            nle = next(iter(num_local_experts.values()))  # MTP's MoE layer: the decoder's count
            name = rename_indices(name, expert=expert_index(name) + _ep_rank() * nle)
        if name == "output_layer.weight" and tied:
            out.append(ParamEntry(local, name, p, None))
            continue
        if name not in maps:
            raise ConversionError(f"model parameter '{local}' ({name}) has no Hugging Face mapping")
        pm = maps[name] if getattr(model, "mtp_layers", 0) else without_mtp_copies(maps[name])
        out.append(ParamEntry(local, name, p, _spec_map(model, local, pm)))
    return out


_BUFFER_WEIGHTS = (".router.expert_bias",)


def _spec_map(model: torch.nn.Module, local: str, pm: ParamMap) -> ParamMap:
    """`pm` with the TP split its module has in this spec: MLA's down projections are
    replicated in the learner's specs (`TELinear` duplicated, the replicated local `Linear`;
    the adapter's maps say so), split on dim 0 where a model was built from Megatron-Core's
    local spec as it is (`ColumnParallelLinear`)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if not local.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
        return pm
    owner = model.get_submodule(local.rsplit(".", 1)[0])
    return replace(pm, tp_dim=0 if isinstance(owner, ColumnParallelLinear) else None)


def _tp_rank_size(pm: ParamMap) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if pm.expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _check_partition(entry: ParamEntry, pm: ParamMap, size: int) -> None:
    p = entry.param
    if not hasattr(p, "tensor_model_parallel"):
        return  # attributes are only set when Megatron initialises weights itself
    dim = p.partition_dim if p.tensor_model_parallel else None
    if size > 1 and dim != pm.tp_dim:
        raise ConversionError(
            f"parameter '{entry.local}' is partitioned on dim {dim}, mapping expects {pm.tp_dim}"
        )


@torch.no_grad()
def load_hf_weights(
    models: list[torch.nn.Module],
    reader: HFCheckpointReader,
    adapter: StateDictAdapter,
    dims: ModelDims,
    progress: bool = False,
    skip_mtp: bool = False,
) -> int:
    """Copy HF weights into this rank's shards of every parameter of `models`.

    Args:
        models: model chunks of this rank (one per virtual pipeline stage).
        reader: the HF checkpoint.
        adapter, dims: from `get_adapter(config)` / `adapter.dims(config)`.
        progress: show a tqdm bar over parameters.
        skip_mtp: leave the MTP layers alone (added ones: not in the checkpoint).
    Returns:
        number of parameters filled; raises ConversionError naming a missing or
        shape-mismatched tensor.
    """
    maps = adapter.maps_by_mcore(dims)
    emb_map = maps["embedding.word_embeddings.weight"]
    emb_map = without_mtp_copies(emb_map) if skip_mtp else emb_map
    entries = [e for m in models for e in model_param_entries(m, maps, dims.tie_embeddings)
               if not (skip_mtp and e.canonical.startswith("mtp."))]
    if skip_mtp:  # nor the embedding / head copies an MTP layer's HF names hold
        entries = [replace(e, pm=e.pm and without_mtp_copies(e.pm)) for e in entries]
    if progress:
        from tqdm import tqdm

        entries = tqdm(entries, desc="hf-to-mcore", unit=" params")
    n = 0
    last: dict[str, torch.Tensor] = {}  # [E, ...] tensors that every expert slices (gpt-oss)

    def get(name: str) -> torch.Tensor:
        if name not in last:
            last.clear()
            last[name] = reader.get(name)
        return last[name]

    for entry in entries:
        pm = entry.pm or emb_map
        padded = entry.param.shape[0] * (_tp_rank_size(pm)[1] if pm.kind in VOCAB_KINDS else 1)
        full = to_mcore_tensor(pm, [get(h) for h in pm.hf], dims, padded)
        rank, size = _tp_rank_size(pm)
        _check_partition(entry, pm, size)
        shard = tp_shard(full, pm, rank, size)
        if shard.shape != entry.param.shape:
            raise ConversionError(
                f"{', '.join(pm.hf)} give {entry.local} shape {tuple(shard.shape)}, "
                f"model expects {tuple(entry.param.shape)}"
            )
        entry.param.copy_(shard)
        n += 1
    return n


def moe_norm_keys_as_te(sharded: dict, model: torch.nn.Module) -> None:
    """Store MoE layers' pre-MLP norm under the Transformer Engine spec's key.

    The local spec maps ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_`` for every
    layer, but the TE spec keeps a separate ``pre_mlp_layernorm`` in MoE layers; renaming here
    makes checkpoints written with either spec load with the other.
    """
    if not getattr(model.config, "num_moe_experts", None):
        return
    for name, sh in sharded.items():
        key = getattr(sh, "key", None)
        if ".pre_mlp_layernorm." in name and key and "mlp.linear_fc1.layer_norm_" in key:
            sh.key = key.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")


def _sharded_state_dict(models: list[torch.nn.Module]) -> dict:
    out = {}
    for i, m in enumerate(models):
        m = unwrap(m)
        sd = m.sharded_state_dict()
        moe_norm_keys_as_te(sd, m)
        # LoRA factors (megatron.lora.adapters) are not part of a base checkpoint
        sd = {k: v for k, v in sd.items() if not k.endswith((".lora_a", ".lora_b"))}
        out["model" if len(models) == 1 else f"model{i}"] = sd
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    models: list[torch.nn.Module],
    ckpt_dir: str | os.PathLike,
    *,
    metadata: dict,
    hf_side_files: str | os.PathLike | None = None,
    force: bool = False,
) -> None:
    """Save a resharding-capable distributed checkpoint of `models` (collective).

    Args:
        models: this rank's model chunks.
        ckpt_dir: target directory (must not exist unless `force`).
        metadata: JSON-able dict stored as ``megatron_gspo_checkpoint.json`` (HF config, dtype).
        hf_side_files: directory whose config / tokenizer files are kept under ``hf_config/``.
        force: replace an existing target.
    """
    from megatron.core import dist_checkpointing

    from megatron_gspo.megatron.io.child_procs import install_checkpoint_results_queue

    out = Path(ckpt_dir)
    if out.exists() and not force:
        raise ConversionError(f"output directory {out} exists (pass --force to overwrite)")
    tmp = out.parent / f".{out.name}.tmp"
    if _rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    try:
        install_checkpoint_results_queue()  # its server dies with this process
        dist_checkpointing.save(_sharded_state_dict(models), str(tmp))
        _barrier()
        if _rank() == 0:
            meta = {"format": FORMAT, **metadata}
            (tmp / META_NAME).write_text(json.dumps(meta, indent=2, default=str) + "\n")
            if hf_side_files is not None:
                (tmp / HF_SIDE_DIR).mkdir()
                copy_side_files(hf_side_files, tmp / HF_SIDE_DIR)
            commit_output_dir(tmp, out)
        _barrier()
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


@torch.no_grad()
def load_checkpoint(models: list[torch.nn.Module], ckpt_dir: str | os.PathLike) -> None:
    """Load a distributed checkpoint into `models` under the current layout (collective).

    Trust: PyTorch distributed checkpointing reads the checkpoint's `.metadata` file with
    `pickle.load` (tensor files load with weights_only), so loading runs code from whoever
    wrote the checkpoint: load only checkpoints from sources you trust.
    """
    from megatron.core import dist_checkpointing

    if not (Path(ckpt_dir) / "metadata.json").is_file():
        raise ConversionError(f"{ckpt_dir}: not a Megatron-Core distributed checkpoint")
    sharded = _sharded_state_dict(models)
    state = dist_checkpointing.load(sharded, str(ckpt_dir))
    keys = ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]
    for key, m in zip(keys, models, strict=True):
        missing, unexpected = unwrap(m).load_state_dict(state[key], strict=False)
        missing = [k for k in missing if not k.endswith((".lora_a", ".lora_b"))]
        if missing or unexpected:  # strict, except for LoRA adapters (not in a base)
            raise ConversionError(f"{ckpt_dir}: checkpoint does not match the model: missing "
                                  f"{missing[:3]}, unexpected {unexpected[:3]}")


def checkpoint_has_mtp(ckpt_dir: str | os.PathLike) -> bool:
    """The distributed checkpoint holds multi-token-prediction layers (its tensor index, read
    with the trust `load_checkpoint` states)."""
    from megatron.core import dist_checkpointing

    return any(".mtp.layers." in f".{k}" for k in dist_checkpointing.load_tensors_metadata(
        str(ckpt_dir)))


def build_rank_models(
    hf_config: Mapping,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    mtp: bool = False,
    **config_kwargs,
) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks under the initialised parallel_state (one per virtual stage).

    Args:
        hf_config: parsed config.json.
        params_dtype: parameter dtype.
        use_te: force the TE / local spec (None: TE when importable).
        mtp: also build the config's multi-token-prediction layers (`models.mtp_block`).
        config_kwargs: extra `build_model_config` arguments (layout sizes are read from
            parallel_state).
    Returns:
        list of GPTModel, in virtual-stage order.
    """
    from megatron.core import parallel_state as ps

    from megatron_gspo.megatron.models.builder import build_gpt_model, build_model_config

    cfg = normalize_hf_config(hf_config)
    # dense configs must not keep the allgather default, which rejects variable_seq_lengths
    config_kwargs.setdefault("moe_token_dispatcher_type", "alltoall")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    config = build_model_config(
        cfg,
        params_dtype=params_dtype,
        tensor_parallel=ps.get_tensor_model_parallel_world_size(),
        pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline=vpp if (vpp or 1) > 1 else None,
        expert_parallel=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel=etp,
        use_te=use_te,
        **config_kwargs,
    )
    models = []
    for vp in range(vpp or 1):
        stage = vp if (vpp or 1) > 1 else None
        models.append(
            build_gpt_model(
                cfg,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage,
                config=config,
                use_te=use_te,
                mtp=mtp,
            )
        )
    return models
