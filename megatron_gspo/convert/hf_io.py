"""Reading and writing Hugging Face safetensors checkpoints.

Reader: lazy per-tensor access to a single-file or index-sharded checkpoint, with one-line errors
for a missing config, a missing tensor, or a corrupt file.
Writer: size-bounded shards plus ``model.safetensors.index.json``, non-weight files (config,
tokenizer, generation config) copied from a source directory; everything is written to a hidden
temporary directory next to the target and renamed into place only on success, so a failed run
never leaves output that looks complete; the temp directory of a killed run is removed by the
next one writing next to it (`convert.tempdirs`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_gspo.convert.param_map import ConversionError
from megatron_gspo.convert.mtp import with_present_mtp_layers
from megatron_gspo.convert.tempdirs import make_temp_dir, mark_owned, release

INDEX_NAME = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt")


def read_config(hf_dir: str | os.PathLike) -> dict:
    """Parsed ``config.json`` of a Hugging Face model directory (ConversionError if absent/bad)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path}: config.json not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from None


class HFCheckpointReader:
    """Lazy reader of the tensors of a safetensors checkpoint directory.

    Args:
        hf_dir: directory with ``model.safetensors`` or an index plus shards.
    """

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        self.config = read_config(self.dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                wmap = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConversionError(f"{index}: not a valid safetensors index ({e})") from None
            self.weight_map = {k: self.dir / v for k, v in wmap.items()}
            for f in set(self.weight_map.values()):
                if not f.is_file():
                    raise ConversionError(f"{index}: lists shard {f.name}, which does not exist")
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ConversionError(f"{self.dir}: no *.safetensors files and no {INDEX_NAME}")
            self.weight_map = {}
            for f in files:
                for k in self._open(f).keys():  # noqa: SIM118 (safe_open is not iterable)
                    self.weight_map[k] = f
        self._handles: dict[Path, object] = {}
        # transformers writes num_nextn_predict_layers=1 with no MTP tensors: count the real ones
        self.config = with_present_mtp_layers(self.config, self.weight_map)

    def _open(self, f: Path):
        try:
            return safe_open(str(f), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise ConversionError(f"corrupt safetensors file {f}: {e}") from None

    def keys(self) -> list[str]:
        """All tensor names."""
        return list(self.weight_map)

    def __iter__(self):
        return iter(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        """(file name, open safetensors handle) holding tensor `name`."""
        f = self.weight_map.get(name)
        if f is None:
            raise ConversionError(f"checkpoint {self.dir} has no tensor '{name}'")
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = self._open(f)
        return f, h

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (ConversionError naming it when missing or unreadable)."""
        f, h = self._handle(name)
        try:
            return h.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ConversionError(f"cannot read tensor '{name}' from {f}: {e}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of one tensor from the file header (no data read)."""
        return tuple(self._handle(name)[1].get_slice(name).get_shape())

    def close(self) -> None:
        """Drop open file handles."""
        self._handles.clear()


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy every non-weight regular file (config, tokenizer, templates) from src to dst.

    Returns:
        names of the copied files.
    """
    copied = []
    for f in sorted(Path(src).iterdir()):
        if not f.is_file() or f.name.endswith(_WEIGHT_SUFFIXES) or f.name.endswith(".index.json"):
            continue
        shutil.copy2(f, Path(dst) / f.name)
        copied.append(f.name)
    return copied


def prepare_output_dir(out_dir: str | os.PathLike, force: bool) -> Path:
    """Check the target and create a fresh hidden temp directory next to it (owned by this
    process; stale ones of interrupted conversions in the same parent are removed first).

    Returns:
        the temporary directory; pass it to `commit_output_dir` once complete.
    """
    out = Path(out_dir)
    if out.exists() and not force:
        raise ConversionError(f"output directory {out} exists (pass --force to overwrite)")
    return make_temp_dir(out)


def commit_output_dir(tmp: Path, out_dir: str | os.PathLike) -> None:
    """Atomically move a completed temp directory into place (replacing an old target)."""
    out = Path(out_dir)
    release(tmp)
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        mark_owned(old)  # removed by a later run if this process dies before deleting it
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t.cpu()


class ShardedSafetensorsWriter:
    """Write tensors into size-bounded safetensors shards under `directory`.

    Args:
        directory: existing (temporary) output directory.
        max_shard_bytes: flush a shard before it would exceed this many bytes (a single bigger
            tensor gets a shard of its own).
        dtype: cast floating tensors to this dtype (None keeps them).
    """

    def __init__(self, directory: Path, max_shard_bytes: int, dtype: torch.dtype | None = None):
        if max_shard_bytes <= 0:
            raise ConversionError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.dir, self.max_bytes, self.dtype = Path(directory), max_shard_bytes, dtype
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._parts: list[list[str]] = []
        self._seen: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor (error on a duplicate name)."""
        if name in self._seen:
            raise ConversionError(f"tensor '{name}' written twice")
        self._seen.add(name)
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_bytes:
            self._flush()
        self._buf[name] = _own_storage(tensor)
        self._buf_bytes += nbytes
        self.total_bytes += nbytes

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in items:
            self.add(name, t)

    def _flush(self) -> None:
        if not self._buf:
            return
        k = len(self._parts)
        save_file(self._buf, str(self.dir / f"part-{k:05d}.safetensors"), metadata={"format": "pt"})
        self._parts.append(list(self._buf))
        self._buf, self._buf_bytes = {}, 0

    def finish(self) -> dict:
        """Flush, give shards their final names, write the index; returns the index dict."""
        self._flush()
        n = len(self._parts)
        if n == 0:
            raise ConversionError("no tensors to write")
        weight_map = {}
        for k, names in enumerate(self._parts):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            (self.dir / f"part-{k:05d}.safetensors").rename(self.dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return index


def save_hf_checkpoint(
    items: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    *,
    side_files_from: str | os.PathLike | None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    force: bool = False,
    config: dict | None = None,
) -> dict:
    """Write a complete Hugging Face checkpoint atomically.

    Args:
        items: (HF name, tensor) pairs, streamed.
        out_dir: target directory (must not exist unless `force`).
        side_files_from: directory whose config/tokenizer files are copied (None: none).
        max_shard_bytes: shard size bound.
        dtype: optional floating dtype to cast to; config.json's dtype is updated to match.
        force: replace an existing target.
        config: written as config.json in place of the copied one (None: keep the copy).
    Returns:
        the index dict written.
    """
    tmp = prepare_output_dir(out_dir, force)
    try:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes, dtype)
        writer.add_all(items)
        index = writer.finish()
        if side_files_from is not None:
            copy_side_files(side_files_from, tmp)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if dtype is not None and (tmp / "config.json").is_file():
            cfg = json.loads((tmp / "config.json").read_text())
            key = "dtype" if "dtype" in cfg else "torch_dtype"
            name = str(dtype).removeprefix("torch.")
            if cfg.get(key) != name:
                cfg[key] = name
                (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        commit_output_dir(tmp, out_dir)
        return index
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def validate_hf_checkpoint(reader: HFCheckpointReader, adapter, dims) -> None:
    """Check names and shapes of every tensor against the mapping, from headers only.

    Args:
        reader: the checkpoint.
        adapter, dims: the architecture's StateDictAdapter and ModelDims.
    Raises:
        ConversionError naming the first missing, unexpected or mis-shaped tensor.
    """
    used = set()
    for pm in adapter.param_maps(dims):
        for name, shape in zip(pm.hf, pm.shapes or [None] * len(pm.hf), strict=True):
            used.add(name)
            got = reader.shape(name)
            if shape is not None and got != tuple(shape):
                raise ConversionError(f"tensor '{name}' has shape {got}, expected {tuple(shape)}")
    for k in reader:
        if k in used or k.endswith("rotary_emb.inv_freq"):
            continue
        if dims.tie_embeddings and k == "lm_head.weight":
            continue
        raise ConversionError(
            f"tensor '{k}' in {reader.dir} is not mapped for {adapter.architectures[0]}"
        )
