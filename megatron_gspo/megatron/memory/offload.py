"""Learner state off the accelerator while colocated SGLang servers generate.

Megatron-Core 0.16.1 lays the learner out in a few large storages that many tensors view: DDP's
gradient buffer (`param.main_grad` and every bucket are views of `buffer.grad_data`), with the
distributed optimizer also its parameter buffer (`param.data` are views of `buffer.param_data`).
Moving `param.data` to another device would break those views, so this module works on storages,
as megatron-core's own `_ParamAndGradBuffer.offload_to_cpu` does: each distinct storage is
copied into a host buffer (pinned when CUDA is present) and then resized to 0 bytes, which frees
its memory and keeps every view (a storage torch marks as not resizable, e.g. a CPU tensor once
viewed by numpy, stays in place, counted in `kept`); `onload` resizes it back and copies the
bytes in. Views see the restored memory because they share the storage object, so the round trip
is bit-exact. Gradient storages are released without a copy and come back zeroed: the learner
zeroes its gradient buffer at the start of every step anyway.

Why not torch_memory_saver (what SGLang itself uses): it needs its allocator hooked in before
the learner allocates and a CUDA build; storage resizing needs neither, works on CPU, and is the
mechanism megatron-core 0.16.1 ships for these buffers. Reading an offloaded tensor is undefined
(an empty storage: garbage or a crash), so the learner refuses to run while offloaded.

On a CPU-only machine the "device" is the CPU too: the host copy is a separate tensor and the
original storages still shrink to 0 bytes, so tests can check that nothing kept its memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

PARTS = ("weights", "grads", "main", "moments", "reference")


def _bytes_view(s: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)


class StorageOffload:
    """Host copies of storages, by part name; `offload` releases, `onload` restores."""

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.parts: dict[str, list[tuple[torch.UntypedStorage, int, torch.Tensor | None]]] = {}
        self._hosts: dict[tuple[str, int], torch.Tensor] = {}  # reused host buffers
        self.kept: dict[str, int] = {}  # bytes left in place (storages that cannot resize)

    def offloaded(self, part: str | None = None) -> bool:
        """`part` (or any part) is off the device: offloaded and not yet onloaded, also when
        it had no storage of its own to release (fp32 main weights are the weights; Adam's
        moments before the first step)."""
        return part in self.parts if part else bool(self.parts)

    def offload(self, part: str, tensors: Iterable[torch.Tensor], *, keep: bool = True,
                skip: set[int] | None = None) -> int:
        """Release the storages of `tensors` (each once; `skip`: storage pointers to leave);
        with `keep` their bytes go to host memory first. Returns the bytes released."""
        if part in self.parts:
            return 0
        seen = set(skip or ())
        recs = []
        for t in tensors:
            s = t.untyped_storage()
            ptr, n = s.data_ptr(), s.nbytes()
            if n == 0 or ptr in seen:
                continue
            seen.add(ptr)
            if not s.resizable():  # e.g. a CPU tensor once viewed by numpy: it stays
                self.kept[part] = self.kept.get(part, 0) + n
                continue
            host = None
            if keep:
                key = (part, len(recs))
                host = self._hosts.get(key)
                if host is None or host.numel() != n:
                    host = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
                    self._hosts[key] = host
                host.copy_(_bytes_view(s), non_blocking=False)
            recs.append((s, n, host))
        if self.pin:
            torch.cuda.synchronize()
        for s, _, _ in recs:
            s.resize_(0)
        self.parts[part] = recs
        return sum(n for _, n, _ in recs)

    def onload(self, part: str) -> int:
        """Give `part`'s storages their memory back (host bytes copied in, or zeros)."""
        recs = self.parts.pop(part, [])
        for s, n, host in recs:
            if not s.resizable():
                raise RuntimeError(f"onload {part}: a storage of {n} bytes was shared while "
                                   "offloaded and cannot be restored")
            s.resize_(n)
            view = _bytes_view(s)
            if host is not None:
                view.copy_(host, non_blocking=self.pin)
            else:
                view.zero_()
        if recs and self.pin:
            torch.cuda.synchronize()
        return sum(n for _, n, _ in recs)


def optimizer_tensors(optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters the inner torch optimizers update, their state tensors but scalars) of a Megatron
    optimizer (chained or not): for bf16 / fp16 models the first are the fp32 main weights
    (or, with the distributed optimizer, this rank's shards of them)."""
    main, state = [], []
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if inner is None:
            continue
        for g in inner.param_groups:
            main += [p for p in g["params"] if isinstance(p, torch.Tensor)]
        for st in inner.state.values():
            # Adam's `step` is a 0-dim tensor (host memory unless capturable): left in place
            state += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return main, state


def grad_buffers(ddp_chunks: list) -> list[torch.Tensor]:
    """The DDP gradient buffers (dense and expert-parallel) of every chunk."""
    return [b.grad_data for m in ddp_chunks
            for b in list(getattr(m, "buffers", [])) + list(getattr(m, "expert_parallel_buffers",
                                                                     []))]
