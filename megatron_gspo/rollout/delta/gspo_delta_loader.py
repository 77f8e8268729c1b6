"""Receiving side of the delta weight sync: SGLang's custom weight loader (`--custom-weight-loader
gspo_delta_loader.load`). Imports nothing but torch and the standard library: it is installed
next to the server (the launcher copies this file into a folder on the server's PYTHONPATH).

SGLang 0.5.12 (srt/model_executor/model_runner.py `update_weights_from_tensor`) calls
`load(model, named_tensors)` for `load_format="gspo_delta_loader.load"`, with the deserialized
list of (name, tensor) pairs of this TP rank. The first call replaces `model.load_weights` on the
model instance with a wrapper, so the same wire format also works where SGLang has no
custom-loader hook: `update_weights_from_distributed` (the NCCL/gloo broadcast) hands the
received pairs to `model.load_weights`.

Wire format of one request (a "delta bucket"): the pairs
    ("__gspo_delta__.manifest", uint8 [bytes of a UTF-8 JSON object]),
    ("__gspo_delta__.<k>", data tensor k), ...
or one pair ("__gspo_delta__.file", uint8 [UTF-8 path]) naming a delta file (`torch.save` of
{"manifest": str, "data": [tensors]}, read with weights_only=True): the disk path.
The manifest: {"format": 1, "base": token or null, "new": token, "tensors": [entry...]}, an
entry {"name", "kind", "dtype", "shape", "parts": [k...]} of kind
    full:   parts [values]                        the new tensor itself,
    sparse: parts [index int32/int64 [n], values [n]]  new = base; new.flat[index] = values,
    xor:    parts [uint8 zlib bytes]              new bits = base bits ^ inflate(bytes).
Every applied tensor is equal bit for bit to the learner's. The loader keeps its own copy of
every tensor it loaded (host memory: one copy of the served weights per TP rank), the base of
the next delta, on the model object (a restarted server starts without one). `base` names the
sync whose result the deltas apply to: a request whose base is not the one held (a restarted
server holds none, a load by another path drops it) is refused (RuntimeError, which ends
SGLang's scheduler on the tensor path; the distributed path answers it as a failed update):
never a delta on top of an unknown base. Within one sync a bucket is applied once: an identical
manifest again (a retrying client or proxy) loads nothing, another bucket naming a tensor the
sync already loaded is refused. Every part is checked against its manifest entry before anything
is decoded (part count, dtype without a cast, lengths, indices inside the tensor), and XOR bytes
inflate to at most the tensor's size.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any

import torch

PREFIX = "__gspo_delta__."
MANIFEST = PREFIX + "manifest"
FILE = PREFIX + "file"
FORMAT = 1
#: Integer views of each float dtype's bit pattern (bitwise compare and XOR).
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
        torch.float64: torch.int64, torch.float8_e4m3fn: torch.int8}  # FP8 rollouts: weights


class DeltaState:
    """What one process (one TP rank of a server) holds: the tensors it last loaded (name ->
    CPU tensor), the token of the sync they belong to and the one before it."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.current: str | None = None  # token of the newest sync seen
        self.previous: str | None = None  # its base (a later bucket of the same sync)
        self.applied: set[str] = set()  # digests of the buckets the current sync applied
        self.loaded: set[str] = set()  # tensor names the current sync loaded

    def reset(self) -> None:
        self.base.clear()
        self.current = self.previous = None
        self.applied.clear()
        self.loaded.clear()

    def check(self, base: str | None, new: str, has_delta: bool) -> None:
        """Accept a request whose deltas apply to a base held here; raise otherwise."""
        if new != self.current:  # the first request of a new sync
            if has_delta and (base is None or base != self.current):
                raise RuntimeError(
                    f"gspo_delta_loader: a delta on base {base!r} but this server holds "
                    f"{self.current!r} (restarted, or loaded by another path): a full sync is "
                    "needed; nothing applied")
            self.previous, self.current = self.current, new
            self.applied.clear()
            self.loaded.clear()
        elif has_delta and base != self.previous:
            raise RuntimeError(f"gspo_delta_loader: sync {new!r} continues on base {base!r}, "
                               f"started on {self.previous!r}; nothing applied")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise RuntimeError(f"gspo_delta_loader: unknown dtype {name!r}")
    return dt


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _entry_problem(entry: Any, data: list[torch.Tensor]) -> str | None:
    """Why `entry` and its parts do not agree with the manifest's own description, or None:
    every part is checked before anything is decoded (a sparse part whose indices and values
    differ in length would broadcast, an index of -1 would write the last element, values of
    another dtype would be cast)."""
    if not isinstance(entry, dict) or not {"name", "kind", "dtype", "shape", "parts"} <= set(
            entry):
        return "an entry without name, kind, dtype, shape and parts"
    shape, ks = entry["shape"], entry["parts"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return f"shape {shape!r} is not a list of sizes"
    if not (isinstance(ks, list) and all(isinstance(k, int) and 0 <= k < len(data) for k in ks)):
        return f"parts {ks!r} name data tensors the request does not hold"
    kind, dt, n = entry["kind"], _dtype(entry["dtype"]), _numel(tuple(shape))
    want = {"full": 1, "sparse": 2, "xor": 1}.get(kind)
    if want is None:
        return f"unknown kind {kind!r}"
    if len(ks) != want:
        return f"{kind} with {len(ks)} parts (expected {want})"
    parts = [data[k] for k in ks]
    if kind == "full" and (parts[0].dtype != dt or parts[0].numel() != n):
        return (f"full values {parts[0].dtype} x {parts[0].numel()}, manifest says {dt} x {n}")
    if kind == "sparse":
        idx, vals = parts
        if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
            return f"sparse index of {idx.dtype} with {idx.dim()} dims (expected 1-D int32/int64)"
        if vals.dim() != 1 or vals.numel() != idx.numel() or vals.dtype != dt:
            return (f"sparse values {vals.dtype} x {vals.numel()} for {idx.numel()} indices "
                    f"(expected {dt} x {idx.numel()})")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            return f"sparse index outside [0, {n})"
    if kind == "xor" and (parts[0].dtype != torch.uint8 or parts[0].dim() != 1
                          or dt not in BITS):
        return f"xor bytes of {parts[0].dtype} for {dt}"
    return None


def _inflate(raw: bytes, size: int) -> bytes:
    """zlib-inflate `raw` to exactly `size` bytes, never more: a stream that inflates past the
    tensor's size (a zlib bomb) stops there and is refused."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(raw, size + 1)
    except zlib.error as e:
        raise RuntimeError(f"gspo_delta_loader: xor bytes are not zlib data ({e})") from None
    if len(out) != size or d.unconsumed_tail or not d.eof:
        got = f"more than {size}" if len(out) > size or d.unconsumed_tail else len(out)
        raise RuntimeError(f"gspo_delta_loader: xor bytes inflate to {got} bytes, the tensor "
                           f"has {size}; nothing applied")
    return out


def decode_entry(entry: dict[str, Any], data: list[torch.Tensor],
                 base: torch.Tensor | None) -> torch.Tensor:
    """The new tensor of one manifest entry (a fresh CPU tensor); every part is checked against
    the manifest first (`_entry_problem`)."""
    problem = _entry_problem(entry, data)
    if problem:
        name = entry.get("name") if isinstance(entry, dict) else entry
        raise RuntimeError(f"gspo_delta_loader: {name!r}: {problem}; nothing applied")
    kind, shape, dt = entry["kind"], tuple(entry["shape"]), _dtype(entry["dtype"])
    parts = [data[k] for k in entry["parts"]]
    if kind == "full":
        return parts[0].detach().to("cpu", copy=True).reshape(shape)
    if base is None or tuple(base.shape) != shape or base.dtype != dt:
        raise RuntimeError(f"gspo_delta_loader: no base of {entry['name']} {shape} {dt} "
                           "held here; a full sync is needed")
    out = base.clone()
    if kind == "sparse":
        out.view(-1)[parts[0].to("cpu").long()] = parts[1].to("cpu")
    else:  # xor
        width = torch.empty((), dtype=BITS[dt]).element_size()
        raw = bytes(parts[0].to("cpu").numpy().tobytes())
        x = torch.frombuffer(bytearray(_inflate(raw, out.numel() * width)), dtype=BITS[dt])
        out.view(-1).view(BITS[dt]).bitwise_xor_(x)
    return out


def bucket_digest(manifest: dict[str, Any]) -> str:
    """A digest of one bucket's manifest (names, kinds, shapes, parts and sync tokens): a
    replayed request has the same. The data is not hashed (a second copy of every bucket);
    a bucket with this manifest is never applied twice in one sync, whatever its data."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode("utf-8")).hexdigest()


def apply_bucket(manifest: dict[str, Any], data: list[torch.Tensor],
                 state: DeltaState) -> list[tuple[str, torch.Tensor]]:
    """Decode one delta bucket against `state` and record the results as the new base.

    A bucket this sync already applied (a retrying client or proxy sends it again) is not
    applied twice: XOR and sparse deltas on top of their own result would revert the weights.
    An identical replay loads nothing; a different bucket naming a tensor this sync already
    loaded is refused.

    Returns:
        (name, full tensor) pairs to hand to the model's own `load_weights`.
    """
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise RuntimeError(f"gspo_delta_loader: manifest format {got!r}, this loader reads "
                           f"{FORMAT}")
    entries = manifest.get("tensors")
    if not isinstance(entries, list) or not isinstance(manifest.get("new"), str):
        raise RuntimeError("gspo_delta_loader: a manifest without its tensors or sync token")
    names = [e.get("name") if isinstance(e, dict) else None for e in entries]
    if len(set(names)) != len(names):
        raise RuntimeError("gspo_delta_loader: a bucket naming one tensor twice; nothing applied")
    used = sorted(k for e in entries if isinstance(e, dict) and isinstance(e.get("parts"), list)
                  for k in e["parts"])
    if used != list(range(len(data))):
        raise RuntimeError(f"gspo_delta_loader: the manifest uses data parts {used[:8]}, the "
                           f"request holds {len(data)}; nothing applied")
    has_delta = any(e.get("kind") != "full" for e in entries)
    digest = bucket_digest(manifest)
    if manifest["new"] == state.current and digest in state.applied:
        return []  # a replay of a bucket this sync applied: already loaded
    state.check(manifest.get("base"), manifest["new"], has_delta)
    again = [n for n in names if n in state.loaded]
    if again:
        raise RuntimeError(f"gspo_delta_loader: sync {manifest['new']!r} already loaded "
                           f"{again[0]} in another bucket; nothing applied")
    out = [(e["name"], decode_entry(e, data, state.base.get(e["name"]))) for e in entries]
    for name, t in out:  # only once every entry decoded: a refused bucket changes nothing
        state.base[name] = t
    state.applied.add(digest)
    state.loaded.update(names)
    return out


def split_request(named: list[tuple[str, torch.Tensor]]) -> tuple[Any, list]:
    """(manifest dict or None, data tensors in order k, other pairs) of one load call."""
    manifest, data, plain = None, {}, []
    for name, t in named:
        if name == MANIFEST:
            manifest = json.loads(bytes(t.to("cpu").numpy().tobytes()).decode("utf-8"))
        elif name == FILE:
            path = bytes(t.to("cpu").numpy().tobytes()).decode("utf-8")
            blob = torch.load(path, map_location="cpu", weights_only=True)
            manifest = json.loads(blob["manifest"])
            data.update(enumerate(blob["data"]))
        elif name.startswith(PREFIX):
            data[int(name[len(PREFIX):])] = t
        else:
            plain.append((name, t))
    return manifest, [data[k] for k in sorted(data)], plain


def install(model: Any) -> DeltaState:
    """Wrap `model.load_weights` (once per model instance, which then holds its `DeltaState`
    as `_gspo_delta_state`): delta buckets are decoded, other weights pass through and drop
    the held base (it no longer describes the served weights)."""
    state = getattr(model, "_gspo_delta_state", None)
    if state is not None:
        return state
    state = DeltaState()
    model._gspo_load_original = model.load_weights  # called at load time: `link_draft` may
    # wrap it, so that the draft gets the decoded tensors

    def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
        named = list(weights)
        manifest, data, plain = split_request(named)
        original = model._gspo_load_original
        if manifest is None:
            if plain:
                state.reset()
            return original(plain, *args, **kwargs)
        if plain:
            raise RuntimeError(f"gspo_delta_loader: a delta bucket with plain tensors "
                               f"({plain[0][0]}); nothing applied")
        return original(apply_bucket(manifest, data, state), *args, **kwargs)

    model.load_weights = load_weights
    model._gspo_delta_state = state
    return state


def load(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader entry: install the wrapper, then load `named_tensors`
    (an empty list only installs it, for servers updated by broadcast)."""
    install(model)
    if named_tensors:
        model.load_weights(named_tensors)


#: Draft models `link_draft` recorded in this process (one TP rank of a server).
_DRAFTS: list = []


def _is_draft(model: Any) -> bool:
    """SGLang's NEXTN / MTP draft classes (configs/model_config.py `_config_draft_model`:
    DeepseekV3ForCausalLMNextN, Glm4MoeForCausalLMNextN, Qwen3NextForCausalLMMTP, ...)."""
    return type(model).__name__.endswith(("NextN", "MTP"))


def _mtp_layer(name: str, first: int) -> bool:
    """`name` is a tensor of an MTP layer: ``model.layers.{i}.*`` with i >= `first`."""
    parts = name.split(".", 3)
    return (len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= first)


def link_draft(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom loader `gspo_delta_loader.link_draft`: makes the distributed path of
    SGLang 0.5.12 update the draft model, which its scheduler skips
    (managers/scheduler_update_weights_mixin.py `update_weights_from_distributed` loads the
    broadcast into the target worker's model only; sglang #27718).

    Posted as an empty `update_weights_from_tensor` with this load_format, it is called once
    per runner of the server process: speculative/eagle_worker.py
    `EAGLEWorker.update_weights_from_tensor` calls the draft runner's model first, then the
    target's. The draft model is recorded; the target's `load_weights` (under the delta
    wrapper, when installed: the draft gets decoded tensors) is wrapped to hand the tensors of
    the MTP layers (layer index >= num_hidden_layers, which the target's loader skips) to each
    recorded draft's own `load_weights` after loading. Calling it again changes nothing.
    """
    if _is_draft(model):
        if not any(d is model for d in _DRAFTS):
            _DRAFTS.append(model)
        if named_tensors:
            getattr(model, "_gspo_load_original", model.load_weights)(list(named_tensors))
        return
    if not getattr(model, "_gspo_draft_linked", False):
        attr = "_gspo_load_original" if hasattr(model, "_gspo_load_original") else "load_weights"
        inner = getattr(model, attr)
        first = int(model.config.num_hidden_layers)

        def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
            named = list(weights)
            out = inner(named, *args, **kwargs)
            mtp = [(n, t) for n, t in named if _mtp_layer(n, first)]
            for draft in _DRAFTS if mtp else ():
                getattr(draft, "_gspo_load_original", draft.load_weights)(mtp)
            return out

        setattr(model, attr, load_weights)
        model._gspo_draft_linked = True
    if named_tensors:
        model.load_weights(list(named_tensors))
