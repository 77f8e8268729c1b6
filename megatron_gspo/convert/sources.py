"""What `mcore-to-hf` converts: a converted checkpoint or one of the trainer's run checkpoints.

Accepted as ``--ckpt``:
- a checkpoint written by ``hf-to-mcore`` (``megatron_gspo_checkpoint.json``, ``hf_config/``);
- a run checkpoint ``runs/<name>/checkpoints/step_N`` (``COMPLETE``, ``model/``), its
  ``model/`` folder, the checkpoints folder or the run directory (newest complete checkpoint).

A run checkpoint is verified against the sizes / sha256 sums its COMPLETE marker lists. Its
Hugging Face config is the one the learner stored next to the weights (`MODEL_INFO`); the
tokenizer and other side files come from ``model.path`` of the run's ``config.yaml`` when that
directory still exists (or from ``--hf-config``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_gspo.convert.param_map import ConversionError
from megatron_gspo.convert.hf_io import read_config

MODEL_INFO = "megatron_gspo_model.json"
META_NAME = "megatron_gspo_checkpoint.json"  # a converted checkpoint's metadata (hf-to-mcore)
HF_SIDE_DIR = "hf_config"  # its HF config and tokenizer files
FORMAT = "megatron_gspo/dist_checkpoint/v1"
_STEP_RE = re.compile(r"^step_\d{8}$")


def write_model_info(model_dir: str | os.PathLike, hf_config: dict, dtype: str,
                     source: str | os.PathLike | None = None) -> None:
    """Store the Hugging Face config a learner checkpoint was written with (rank 0 only).

    Args:
        model_dir: the torch_dist folder just written.
        hf_config: the learner's parsed config.json.
        dtype: parameter dtype name ("float32", "bfloat16", "float16").
        source: the initial weights (`model.load_checkpoint` or `model.path`), recorded with
            their `weights_fingerprint`.
    """
    info = {"hf_config": hf_config, "dtype": dtype}
    if source is not None:
        info.update(source=str(source), source_fingerprint=weights_fingerprint(source),
                    tokenizer_fingerprint=tokenizer_fingerprint(source))
    (Path(model_dir) / MODEL_INFO).write_text(json.dumps(info, indent=1, default=str) + "\n")


def read_model_info(model_dir: str | os.PathLike) -> dict | None:
    """What `write_model_info` stored (None: nothing stored or unreadable)."""
    try:
        info = json.loads((Path(model_dir) / MODEL_INFO).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("hf_config"), dict) else None


_WEIGHT_GLOBS = ("*.safetensors", "*.distcp", "*.bin", "*.pt")
_SAMPLE = 1 << 16


def weights_fingerprint(model_dir: str | os.PathLike) -> str | None:
    """A cheap identity of the weights in `model_dir` (Hugging Face or torch_dist): sha256 over
    each weight file's name and size and 64 KiB read at its start, middle and end. A copy
    matches; other weights (another model, a fine-tune of the same one) differ. None when the
    directory holds no weight file."""
    import hashlib

    d = Path(model_dir)
    files = sorted({p for g in _WEIGHT_GLOBS for p in d.glob(g) if p.is_file()})
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            for at in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                fh.seek(at)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
# config.json fields beyond the architecture (`guards.model_fields`) that a converted model
# must keep: its context length and the special token ids its tokenizer pairs with
IDENTITY_FIELDS = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_fingerprint(model_dir: str | os.PathLike) -> str | None:
    """sha256 over the name and bytes of each tokenizer file in `model_dir` (`TOKENIZER_FILES`);
    None when it holds none (or is not a directory)."""
    import hashlib

    d = Path(model_dir)
    files = [d / n for n in TOKENIZER_FILES if (d / n).is_file()] if d.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0".encode() + f.read_bytes() + b"\0")
    return h.hexdigest()


def other_model(given_dir: str | os.PathLike, given_cfg: dict, src: "CheckpointSource",
                flag: str = "--hf-config") -> str | None:
    """Why `given_dir` (its config `given_cfg`) is not the model `src` was written from, as one
    phrase, or None: the context length or special token ids differ from the stored config;
    its tokenizer files differ from those recorded with the checkpoint (or, not recorded, from
    the run's model.path / the converted checkpoint's copy); or it holds weights other than the
    ones the checkpoint was trained or converted from (`weights_fingerprint`)."""
    stored = src.stored_config or {}
    diff = [k for k in IDENTITY_FIELDS if k in stored and given_cfg.get(k) != stored[k]]
    if diff:
        shown = "; ".join(f"{k}: {given_cfg.get(k)!r} vs {stored[k]!r}" for k in diff)
        return f"{flag} {given_dir}: config.json differs from the checkpoint's ({shown})"
    mine = tokenizer_fingerprint(given_dir)
    theirs = src.recorded.get("tokenizer_fingerprint") or (
        tokenizer_fingerprint(src.side_dir) if src.side_dir is not None else None)
    if mine is not None and theirs is not None and mine != theirs:
        where = src.recorded.get("source") or src.side_dir
        return (f"{flag} {given_dir}: its tokenizer files differ from the ones of {where}, "
                "the model the checkpoint was written from")
    if weights_fingerprint(given_dir) is not None:
        why = other_weights(given_dir, src.recorded.get("source"),
                            src.recorded.get("source_fingerprint"))
        if why is not None:
            return f"{flag} {why}"
    return None


def other_weights(given: str | os.PathLike, recorded: str | None,
                  fingerprint: str | None = None) -> str | None:
    """Why the weights in `given` are not the `recorded` ones (path, and their fingerprint
    when one was stored), as a phrase; None when they are the same or nothing tells."""
    if not recorded:
        return None
    same_path = os.path.realpath(given) == os.path.realpath(recorded)
    if fingerprint is None:  # recorded without one: compare with the recorded path's files
        if same_path or not Path(recorded).is_dir():
            return None
        fingerprint = weights_fingerprint(recorded)
        if fingerprint is None:
            return None
    if weights_fingerprint(given) == fingerprint:
        return None
    if same_path:
        return f"the weights in {given} changed since the checkpoint was written"
    return f"{given} holds other weights than {recorded}, which the checkpoint was trained from"


@dataclass
class CheckpointSource:
    """A resolved ``--ckpt``.

    Attributes:
        kind: "converted" or "run".
        root: the checkpoint directory (converted checkpoint, or the run's step_N folder).
        dist_dir: the torch_dist folder holding the weights.
        stored_config: the config stored with the checkpoint (None: none stored).
        side_dir: where config/tokenizer files can be copied from (None: none known).
        dtype: parameter dtype name recorded with the checkpoint (None: read the tensors').
        notes: lines to show the user (which checkpoint was picked, what was verified).
        recorded: what the checkpoint records of the model it was written from: source (its
            directory), source_fingerprint, tokenizer_fingerprint (each may be missing).
    """

    kind: str
    root: Path
    dist_dir: Path
    stored_config: dict | None = None
    side_dir: Path | None = None
    dtype: str | None = None
    notes: list[str] = field(default_factory=list)
    recorded: dict = field(default_factory=dict)

    def inputs(self, given: str | os.PathLike, flag: str = "--ckpt") -> dict:
        """What an output directory must stay apart from (`guards.check_out_disjoint`): the
        path as given, the checkpoint, and for a run checkpoint its checkpoint directory and
        the run directory holding it."""
        out = {flag: given, f"{flag} checkpoint": self.root}
        if self.kind == "run":
            out[f"the checkpoint dir of {flag}"] = self.root.parent
            out[f"the run dir of {flag}"] = run_dir_of(self.root)
        return out


def run_dir_of(step: Path) -> Path | None:
    """The run directory of run checkpoint `step` (RUN/checkpoints/step_N, or a run dir with
    its config.yaml two levels up), None when the checkpoints live elsewhere
    (`checkpoint.dir`)."""
    run = step.parent.parent
    return run if step.parent.name == "checkpoints" or (run / "config.yaml").is_file() else None


def _step_dir(path: Path, notes: list[str]) -> Path | None:
    """The run checkpoint (step_N folder) `path` designates, or None if it is not one."""
    from megatron_gspo.runtime.run_checkpoint import Checkpointer

    if (path / "COMPLETE").is_file() or (_STEP_RE.match(path.name) and (path / "model").is_dir()):
        return path
    if path.name == "model" and (path / "metadata.json").is_file() and (
        (path.parent / "COMPLETE").is_file() or _STEP_RE.match(path.parent.name)
    ):
        return path.parent
    for root in (path / "checkpoints", path):
        done = Checkpointer(root).complete() if root.is_dir() else []
        if done:
            notes.append(f"newest complete checkpoint under {root}: {done[-1][1].name}")
            return done[-1][1]
    return None


def _run_model_path(step: Path) -> Path | None:
    """``model.path`` from the run's config.yaml (the run dir holds checkpoints/step_N)."""
    run_dir = step.parent.parent
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        return None
    try:
        model = (yaml.safe_load(cfg_file.read_text()) or {}).get("model") or {}
    except (yaml.YAMLError, UnicodeDecodeError, AttributeError):
        return None
    path = model.get("path") if isinstance(model, dict) else None
    if not isinstance(path, str) or not path:
        return None
    for cand in (Path(path), run_dir / path):
        if (cand / "config.json").is_file():
            return cand
    return None


def _run_source(step: Path, notes: list[str]) -> CheckpointSource:
    from megatron_gspo.runtime.run_checkpoint import read_marker, verify

    if not (step / "COMPLETE").is_file():
        raise ConversionError(
            f"run checkpoint {step} is incomplete (no COMPLETE marker: its save did not finish)"
        )
    try:
        listed = isinstance(read_marker(step).get("files"), dict)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    if listed:
        problem = verify(step)
        if problem is not None:
            raise ConversionError(f"{problem}; refusing to convert a damaged checkpoint")
        notes.append(f"verified {step} against its COMPLETE marker")
    else:
        notes.append(f"{step}: COMPLETE lists no file sizes or checksums; not verified")
    dist_dir = step / "model"
    if not (dist_dir / "metadata.json").is_file():
        raise ConversionError(f"run checkpoint {step} has no model/ torch_dist checkpoint")
    stored, dtype, info = None, None, {}
    info_file = dist_dir / MODEL_INFO
    if info_file.is_file():
        try:
            info = json.loads(info_file.read_text())
            stored, dtype = dict(info["hf_config"]), info.get("dtype")
        except (ValueError, KeyError, TypeError) as e:
            raise ConversionError(f"{info_file}: unreadable ({e})") from None
    return CheckpointSource("run", step, dist_dir, stored, _run_model_path(step), dtype, notes,
                            _recorded(info))


def _recorded(info: dict) -> dict:
    """The model identity fields of a checkpoint's metadata (strings only)."""
    keys = ("source", "source_fingerprint", "tokenizer_fingerprint")
    return {k: info[k] for k in keys if isinstance(info.get(k), str)}


def read_checkpoint_metadata(ckpt_dir: str | os.PathLike) -> dict:
    """The metadata dict of a checkpoint written by
    `megatron.io.dist_checkpoint.save_checkpoint`."""
    path = Path(ckpt_dir) / META_NAME
    if not path.is_file():
        raise ConversionError(f"{ckpt_dir}: not a megatron_gspo checkpoint ({META_NAME} missing)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ConversionError(f"{path}: unknown format {meta.get('format')!r}, expected {FORMAT}")
    return meta


def resolve_checkpoint(ckpt: str | os.PathLike) -> CheckpointSource:
    """Resolve ``--ckpt`` (see the module docstring); one-line ConversionError otherwise."""
    path = Path(ckpt)
    if not path.is_dir():
        raise ConversionError(f"--ckpt {ckpt}: no such directory")
    if (path / META_NAME).is_file():
        meta = read_checkpoint_metadata(path)
        side = path / HF_SIDE_DIR
        stored = read_config(side) if (side / "config.json").is_file() else None
        return CheckpointSource("converted", path, path, stored, side if side.is_dir() else None,
                                meta.get("dtype"), recorded=_recorded(meta))
    notes: list[str] = []
    step = _step_dir(path, notes)
    if step is None:
        raise ConversionError(
            f"{ckpt}: not a megatron_gspo checkpoint (neither {META_NAME} of a converted "
            "checkpoint nor a run checkpoint step_N with COMPLETE and model/)"
        )
    return _run_source(step, notes)
