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
never a delta on top of an unknown base.
"""

from __future__ import annotations

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
        torch.float64: torch.int64}


class DeltaState:
    """What one process (one TP rank of a server) holds: the tensors it last loaded (name ->
    CPU tensor), the token of the sync they belong to and the one before it."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.current: str | None = None  # token of the newest sync seen
        self.previous: str | None = None  # its base (a later bucket of the same sync)

    def reset(self) -> None:
        self.base.clear()
        self.current = self.previous = None

    def check(self, base: str | None, new: str, has_delta: bool) -> None:
        """Accept a request whose deltas apply to a base held here; raise otherwise."""
        if new != self.current:  # the first request of a new sync
            if has_delta and (base is None or base != self.current):
                raise RuntimeError(
                    f"gspo_delta_loader: a delta on base {base!r} but this server holds "
                    f"{self.current!r} (restarted, or loaded by another path): a full sync is "
                    "needed; nothing applied")
            self.previous, self.current = self.current, new
        elif has_delta and base != self.previous:
            raise RuntimeError(f"gspo_delta_loader: sync {new!r} continues on base {base!r}, "
                               f"started on {self.previous!r}; nothing applied")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise RuntimeError(f"gspo_delta_loader: unknown dtype {name!r}")
    return dt


def decode_entry(entry: dict[str, Any], data: list[torch.Tensor],
                 base: torch.Tensor | None) -> torch.Tensor:
    """The new tensor of one manifest entry (a fresh CPU tensor)."""
    kind, shape, dt = entry["kind"], tuple(entry["shape"]), _dtype(entry["dtype"])
    parts = [data[k] for k in entry["parts"]]
    if kind == "full":
        out = parts[0].detach().to("cpu", copy=True).reshape(shape)
    else:
        if base is None or tuple(base.shape) != shape or base.dtype != dt:
            raise RuntimeError(f"gspo_delta_loader: no base of {entry['name']} {shape} {dt} "
                               "held here; a full sync is needed")
        out = base.clone()
        if kind == "sparse":
            idx, vals = parts[0].to("cpu").long(), parts[1].to("cpu")
            out.view(-1)[idx] = vals.to(dt)
        elif kind == "xor":
            raw = bytes(parts[0].to("cpu").numpy().tobytes())
            x = torch.frombuffer(bytearray(zlib.decompress(raw)), dtype=BITS[dt])
            out.view(-1).view(BITS[dt]).bitwise_xor_(x)
        else:
            raise RuntimeError(f"gspo_delta_loader: unknown kind {kind!r}")
    if out.dtype != dt:
        raise RuntimeError(f"gspo_delta_loader: {entry['name']} arrived as {out.dtype}, "
                           f"manifest says {dt}")
    return out


def apply_bucket(manifest: dict[str, Any], data: list[torch.Tensor],
                 state: DeltaState) -> list[tuple[str, torch.Tensor]]:
    """Decode one delta bucket against `state` and record the results as the new base.

    Returns:
        (name, full tensor) pairs to hand to the model's own `load_weights`.
    """
    if manifest.get("format") != FORMAT:
        raise RuntimeError(f"gspo_delta_loader: manifest format {manifest.get('format')!r}, "
                           f"this loader reads {FORMAT}")
    entries = manifest["tensors"]
    has_delta = any(e["kind"] != "full" for e in entries)
    state.check(manifest.get("base"), manifest["new"], has_delta)
    out = [(e["name"], decode_entry(e, data, state.base.get(e["name"]))) for e in entries]
    for name, t in out:  # only once every entry decoded: a refused bucket changes nothing
        state.base[name] = t
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
    original = model.load_weights

    def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
        named = list(weights)
        manifest, data, plain = split_request(named)
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
