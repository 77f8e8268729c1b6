"""The learner's side of the delta weight sync: what the engine last acknowledged, the choice
between a full and a delta sync, and the per-sync metrics.

Two ways to remember the engine's weights (`base`):
- "copy": a CPU copy of every exported tensor as the engine last acknowledged it (bytes = the
  exported weights in the served dtype, on the rank that talks to the engines). Deltas are
  encoded against it (`codec.encode_tensor`) and decoded by the server's custom loader.
- "hash": a BLAKE2b digest per tensor (64 bytes each). A tensor whose digest did not change is
  not sent; a changed one is sent in full by SGLang's own loaders (no custom loader needed).

A sync is full (never a delta on top of an unknown base) when no base is held: the first sync of
a process (also after a resume), and after `invalidate` (a server restarted or reports another
weight version, a release of the weights region, a failed or unverified sync). `auto` also sends
a full sync when the last sync's changed share was at or above the threshold (the full sync
still measures the share, so `auto` comes back to deltas once updates get sparse again).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_gspo.rollout.delta.codec import Encoded, encode_tensor, pack, wire_bytes

MODES = ("auto", "on", "off")
BASES = ("copy", "hash")


def digest(t: torch.Tensor) -> bytes:
    """BLAKE2b of a tensor's dtype, shape and bytes (moved to CPU)."""
    c = t.detach().contiguous().cpu()
    h = hashlib.blake2b(f"{c.dtype}{tuple(c.shape)}".encode())
    if c.numel():
        h.update(c.reshape(-1).view(torch.uint8).numpy())
    return h.digest()


@dataclass
class SyncStats:
    """One sync's numbers (`weight_sync/delta_*` metrics)."""

    delta: bool = False
    reason: str = ""
    numel: int = 0  # elements compared with a base
    changed: int = 0  # of those, the ones whose bit pattern changed
    bytes_sent: int = 0
    bytes_full: int = 0
    encode_s: float = 0.0
    apply_s: float = 0.0
    kinds: dict[str, int] = field(default_factory=lambda: {"same": 0, "sparse": 0, "xor": 0,
                                                           "full": 0})

    def share(self) -> float | None:
        """Changed share of the elements compared with a base (None: nothing compared)."""
        return self.changed / self.numel if self.numel else None

    def metrics(self) -> dict[str, float]:
        out = {"delta": float(self.delta), "delta_bytes_sent": float(self.bytes_sent),
               "delta_bytes_full": float(self.bytes_full),
               "delta_encode_s": self.encode_s, "delta_apply_s": self.apply_s}
        out.update({f"delta_tensors_{k}": float(v) for k, v in self.kinds.items()})
        if self.numel:
            out["delta_changed_share"] = float(self.share())
        return out


class DeltaSender:
    """Base of the engine's weights and the encoder of each sync (one per engine).

    Args:
        mode: auto | on | off (`rollout.weight_sync_delta`).
        threshold: auto: a delta sync follows a sync whose changed share was below this.
        base: copy | hash (see module docstring).
        xor_min_share: changed share of a tensor from which its XOR encoding is tried.
        together: HF name -> (group key, size) or None: tensors the engine's loader fuses on
            load and drops when one arrives alone (the exporter keeps a group in one bucket,
            `StateDictAdapter.bucket_group`); when one of a group is sent, all of it is.
    """

    def __init__(self, mode: str = "auto", threshold: float = 0.5, base: str = "copy",
                 xor_min_share: float = 0.05,
                 together: Callable[[str], tuple[str, int] | None] | None = None) -> None:
        if mode not in MODES or base not in BASES:
            raise ValueError(f"delta sync mode {mode!r} / base {base!r}: expected one of "
                             f"{MODES} / {BASES}")
        self.mode, self.threshold, self.base_kind = mode, threshold, base
        self.xor_min_share = xor_min_share
        self.together = together
        self.session = uuid.uuid4().hex[:12]  # tokens of this process: a new one never matches
        self.base: dict[str, torch.Tensor | bytes] = {}
        self.acked_version: int | None = None
        self.last_share: float | None = None
        self.invalid_reason: str | None = "first sync"
        self.releases_seen = 0  # the engine's count of weights-region releases at the last sync
        self.stats = SyncStats()
        self._pending: list[tuple[str, Encoded | bytes, torch.Tensor]] = []
        self._version: int | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def token(self, version: int | None) -> str | None:
        return None if version is None else f"{self.session}:{version}"

    def base_bytes(self) -> int:
        """Host memory the base holds now."""
        return sum(v.numel() * v.element_size() if isinstance(v, torch.Tensor) else len(v)
                   for v in self.base.values())

    def invalidate(self, reason: str) -> None:
        """Forget the base: the next sync is full (`reason` is reported with it)."""
        self.base.clear()
        self.acked_version = None
        self.invalid_reason = reason

    def begin(self, version: int) -> SyncStats:
        """Decide this sync's kind and reset its stats."""
        if self.invalid_reason is not None or self.acked_version is None:
            delta, reason = False, self.invalid_reason or "no base"
        elif self.mode == "auto" and self.last_share is not None and (
                self.last_share >= self.threshold):
            delta, reason = False, (f"changed share {self.last_share:.3g} >= threshold "
                                    f"{self.threshold:g}")
        else:
            delta, reason = True, "delta"
        self.stats = SyncStats(delta=delta, reason=reason)
        self._version, self._pending = version, []
        return self.stats

    def encode(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The pairs to send for one bucket: a delta bucket in the loader's format (base copy),
        or the plain pairs that changed (base hash; all of them in a full sync)."""
        t0 = time.perf_counter()
        st, out = self.stats, []
        if self.base_kind == "hash":
            digests = [digest(t) for _, t in named]
            keep = self._partners([self.base.get(n) == d for (n, _), d in zip(
                named, digests, strict=True)], named)
            for (name, t), d, partner in zip(named, digests, keep, strict=True):
                same = self.base.get(name) == d
                n = t.numel()
                if name in self.base:
                    st.numel += n
                    st.changed += 0 if same else n  # per tensor: all or nothing
                st.bytes_full += n * t.element_size()
                if same and st.delta and not partner:
                    st.kinds["same"] += 1
                    continue
                st.kinds["full"] += 1
                st.bytes_sent += n * t.element_size()
                self._pending.append((name, d, t))
                out.append((name, t))
        else:
            first = [encode_tensor(name, self.base.get(name), t, self.xor_min_share)
                     for name, t in named]
            keep = self._partners([e.kind == "same" for e in first], named)
            encs = []
            for (name, t), e, partner in zip(named, first, keep, strict=True):
                if name in self.base:
                    st.numel += e.numel
                    st.changed += e.changed
                st.bytes_full += e.numel * t.element_size()
                if partner:  # unchanged, sent for its group: one element rewritten in place
                    e = Encoded(name, "sparse", t.dtype, tuple(t.shape), [
                        torch.zeros(1, dtype=torch.int32, device=t.device),
                        t.detach().reshape(-1)[:1].clone()], 0, e.numel, 4 + t.element_size())
                if not st.delta and e.kind != "full":  # a full sync sends every tensor whole
                    e = Encoded(name, "full", t.dtype, tuple(t.shape), [t.detach().contiguous()],
                                e.changed, e.numel, e.numel * t.element_size())
                if e.kind == "full" and not e.parts[0].is_cuda:
                    # the exported tensor may be a live parameter's storage, and pickling a host
                    # tensor for shared memory moves its storage into shared memory in place
                    # (torch's file_system reduction); an offloaded learner then resizes a
                    # mapping it does not own (a segfault): host payloads send a copy
                    e.parts = [e.parts[0].clone()]
                st.kinds[e.kind] += 1
                encs.append(e)
                self._pending.append((name, e, t))
            base = self.token(self.acked_version) if st.delta else None
            out = pack(encs, base, self.token(self._version))
            st.bytes_sent += wire_bytes(out)
        st.encode_s += time.perf_counter() - t0
        return out

    def _partners(self, same: list[bool], named: list) -> list[bool]:
        """Per tensor of a bucket: unchanged (`same`) but sent all the same, because another
        tensor of its `together` group is sent."""
        if self.together is None:
            return [False] * len(named)
        keys = [self.together(n) for n, _ in named]
        sent = {k[0] for k, s in zip(keys, same, strict=True) if k is not None and not s}
        return [s and k is not None and k[0] in sent for k, s in zip(keys, same, strict=True)]

    def commit(self) -> None:
        """The engines acknowledged the buckets encoded since the last commit: they are the
        base now (sparse changes are written into the held copy, others copied whole)."""
        t0 = time.perf_counter()
        for name, e, t in self._pending:
            if isinstance(e, bytes):
                self.base[name] = e
            elif e.kind == "same":
                continue
            elif e.kind == "sparse" and name in self.base:
                self.base[name].view(-1)[e.parts[0].cpu().long()] = e.parts[1].cpu()
            else:
                held = self.base.get(name)
                if held is not None and held.shape == t.shape and held.dtype == t.dtype:
                    held.copy_(t.detach())
                else:
                    self.base[name] = t.detach().to("cpu", copy=True).contiguous()
        self._pending = []
        self.stats.encode_s += time.perf_counter() - t0

    def finish(self, ok: bool, reason: str = "the sync failed") -> SyncStats:
        """End the sync: acknowledged (`ok`) or the base is forgotten."""
        if ok:
            self.acked_version, self.invalid_reason = self._version, None
            self.last_share = self.stats.share()
        else:
            self.invalidate(reason)
        self._pending = []
        return self.stats
