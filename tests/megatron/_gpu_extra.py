"""GPU-only checks of the learner check's `gpu` case (tests/megatron/_workers.py)."""

from __future__ import annotations

import torch


def check_grads_finite_cuda(chk, info: dict) -> None:
    """`grads_finite` on a CUDA buffer: finds NaN / inf anywhere, and allocates far less than
    the buffer (a bool mask would be a quarter of an fp32 buffer)."""
    import types

    from megatron_gspo.megatron.optimizer import grads_finite

    buf = torch.zeros(64 * 2**20, device="cuda")  # 256 MiB
    chunk = types.SimpleNamespace(buffers=[types.SimpleNamespace(grad_data=buf)])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ok = grads_finite([chunk])
    extra = torch.cuda.max_memory_allocated() - base
    info["grads_finite.cuda_extra_bytes"] = extra
    found = []
    for i in (0, buf.numel() // 2, buf.numel() - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            buf[i] = bad
            found.append(not grads_finite([chunk]))
            buf[i] = 0.0
    if not ok or not all(found) or extra >= buf.numel() // 16:
        chk.failures.append(f"grads_finite on CUDA: finite={ok}, found {sum(found)}/9 non-finite, "
                            f"{extra} bytes allocated for a {buf.numel() * 4}-byte buffer")
