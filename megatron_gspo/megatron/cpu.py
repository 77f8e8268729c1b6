"""Run Megatron-Core without CUDA (gloo backend): a small compatibility layer for laptops and CI.

Megatron-Core assumes CUDA in a few dozen places: `device="cuda"` / `torch.cuda.current_device()`
when allocating buffers, `Tensor.cuda()`, `torch.cuda` RNG / streams / events / memory stats,
`Tensor.type()` strings compared to "torch.cuda.FloatTensor", tensor split sizes passed to
`all_to_all_single`. `enable()` makes all of those work on the CPU, with no edit to installed
files:

1. A process-global `TorchFunctionMode` rewrites every CUDA device ("cuda", "cuda:N",
   torch.device("cuda"), a bare int index) to "cpu" in `device=` keyword arguments and in
   `Tensor.to(...)`; `Tensor.cuda()` / `pin_memory()` return the tensor, `pin_memory=True`
   becomes False, `record_stream` is a no-op. torch routes Python-level overridable functions
   (e.g. `torch.autograd.backward`) through function modes, which pops the mode for the whole
   call; such calls are re-dispatched with the mode re-entered, so backward passes (MoE
   all-to-all backward allocates on "cuda") stay covered.
2. `Tensor.type()` (no argument) reports the CUDA type name of CPU float tensors
   ("torch.cuda.FloatTensor", Half, BFloat16): Megatron's optimizers and grad clipping bucket
   tensors by these strings.
3. `torch.cuda` stand-ins, with "device 0 is the CPU": current_device -> 0, set_device /
   synchronize / empty_cache no-ops, Stream / Event / stream contexts synchronous no-ops,
   nvtx no-ops, zero memory statistics, and the CUDA RNG mapped onto `torch.default_generator`
   (get/set_rng_state, manual_seed, default_generators; `_lazy_call` runs at once) so
   Megatron's RNG tracker forks and restores the CPU generator. `is_available()` stays False.
   Names already bound by `from torch.cuda import X` in imported Megatron modules are re-bound.
4. `torch.distributed.all_to_all_single` accepts tensor split sizes (converted to lists, which
   Megatron only does for CUDA tensors); `all_gather` accepts outputs of different sizes (the
   MoE dispatcher gathers per-rank token counts under TP + EP; gloo needs equal sizes).
5. `te_general_gemm`, referenced by the MoE router without Transformer Engine, is set to None
   (`fallbacks.bind_missing_te_names`, which the model builder also runs on GPU machines).
6. torch.compile is disabled (`torch._dynamo.config.disable`): Megatron compiles a few small
   helpers, which costs tens of seconds cold on a CPU and gains nothing there.

`enable()` is a no-op when CUDA is available. `enable(trace=True)` logs each rewrite once per
call site (file:line), which finds the new CUDA assumptions after a Megatron-Core upgrade.

Proven with torch 2.13.0 (needs `torch.overrides.redispatch_function`) and megatron-core 0.16.1 and
0.19.2 (`TESTED_VERSIONS`; the .venv312 test tier); other versions warn.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
import warnings

import torch
import torch._dynamo
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

TESTED_VERSIONS = {"torch": ("2.13",), "megatron.core": ("0.16", "0.19")}

_state: dict = {"enabled": False, "mode": None, "trace": False, "seen": set()}


# ----------------------------------------------------------------------------- device rewriting
def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    return isinstance(dev, int) and not isinstance(dev, bool)


def _trace(what: str) -> None:
    """Log `what` with the first caller outside this file and torch (once per call site)."""
    if not _state["trace"]:
        return
    frame = sys._getframe(2)
    while frame and ("/torch/" in frame.f_code.co_filename
                     or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "?"
    if (site, what) not in _state["seen"]:
        _state["seen"].add((site, what))
        log.warning("cpu-compat rewrite %s at %s", what, site)


_IDENTITY_METHODS = {torch.Tensor.cuda: "Tensor.cuda", torch.Tensor.pin_memory: "pin_memory"}


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made while active."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = _IDENTITY_METHODS.get(func)
        if name is not None:
            _trace(name)
            return args[0]
        if func is torch.device and len(args) == 1 and not kwargs and _is_cuda_device(args[0]) \
                and not isinstance(args[0], (str, torch.device)):
            # `torch.device(torch.cuda.current_device())` (MLA's yarn rotary embedding): a bare
            # index means an accelerator, which torch refuses to build without one
            _trace(f"torch.device({args[0]!r})")
            return torch.device("cpu")
        if func is torch.Tensor.record_stream:
            _trace("record_stream")
            return None
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            _trace(f"device={kwargs['device']!r}")
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            _trace("pin_memory=True")
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            _trace(f"Tensor.to({args[1]!r})")
            args = (args[0], "cpu", *args[2:])
        if isinstance(func, types.FunctionType):
            # Python-level function dispatched through the mode (the mode is popped while it
            # runs): re-enter the mode so the torch calls inside it are rewritten as well.
            with self:
                return torch.overrides.redispatch_function(func, types_, args, kwargs)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- Tensor.type names
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _patched_type(orig):
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            name = _CUDA_TYPE_NAMES.get(self.dtype)
            if name is not None:
                return name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.")
        if dtype is None:
            return orig(self, **kwargs)
        return orig(self, dtype, non_blocking, **kwargs)

    return type_


# ----------------------------------------------------------------------------- torch.cuda stand-ins
class _NoopStream:
    """Synchronous stand-in for torch.cuda.Stream / ExternalStream."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _NoopEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NoopEvent:
    """Synchronous stand-in for torch.cuda.Event."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NoopMemPool:
    def __init__(self, *args, **kwargs):
        pass


def _noop(*args, **kwargs):
    return None


def _fresh_noop():
    # torch._dynamo keeps one rule per torch.cuda function object: every stand-in must be a
    # distinct function, or dynamo's rule map reports duplicates.
    def noop(*args, **kwargs):
        return None

    return noop


def _cuda_stand_ins() -> dict:
    gen = torch.default_generator
    return {
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "set_device": _fresh_noop(),
        "synchronize": _fresh_noop(),
        "empty_cache": _fresh_noop(),
        "Stream": _NoopStream,
        "ExternalStream": _NoopStream,
        "Event": _NoopEvent,
        "current_stream": lambda *a, **k: _NoopStream(),
        "default_stream": lambda *a, **k: _NoopStream(),
        "set_stream": _fresh_noop(),
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "device": lambda *a, **k: contextlib.nullcontext(),
        "MemPool": _NoopMemPool,
        "use_mem_pool": lambda *a, **k: contextlib.nullcontext(),
        "memory_stats": lambda *a, **k: {},
        "memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "get_rng_state": lambda *a, **k: gen.get_state(),
        "set_rng_state": lambda state, *a, **k: gen.set_state(state),
        "manual_seed": lambda seed: gen.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: gen.manual_seed(int(seed)),
        "default_generators": (gen,),
        "_lazy_call": lambda fn, *a, **k: fn(),
        "_lazy_init": _fresh_noop(),
    }


def _install_cuda_stand_ins() -> None:
    stand_ins = _cuda_stand_ins()
    for name, value in stand_ins.items():
        setattr(torch.cuda, name, value)
    torch.cuda.random.get_rng_state = stand_ins["get_rng_state"]
    torch.cuda.random.set_rng_state = stand_ins["set_rng_state"]
    torch.cuda.nvtx.range_push = _fresh_noop()
    torch.cuda.nvtx.range_pop = _fresh_noop()
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    # Re-bind `from torch.cuda import X` aliases in Megatron modules imported before enable().
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("megatron") or mod is None:
            continue
        for alias, target in (("_lazy_call", "_lazy_call"), ("_lazy_init", "_lazy_init"),
                              ("device_ctx_manager", "device")):
            if hasattr(mod, alias):
                setattr(mod, alias, stand_ins[target])


# ----------------------------------------------------------------------------- collectives
def _patch_all_to_all_single() -> None:
    orig = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return orig(output, input, output_split_sizes, input_split_sizes, group=group,
                    async_op=async_op)

    dist.all_to_all_single = all_to_all_single

    orig_all_gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        # gloo needs equal sizes; Megatron's MoE dispatcher gathers per-rank token counts
        # that differ (NCCL allows it). Pad the flattened tensors to the largest, then trim.
        sizes = [t.numel() for t in tensor_list]
        if len(set(sizes)) <= 1:
            return orig_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        _trace("uneven all_gather")
        width = max(sizes)
        flat = tensor.new_zeros(width)
        flat[: tensor.numel()] = tensor.reshape(-1)
        bufs = [tensor.new_empty(width) for _ in tensor_list]
        orig_all_gather(bufs, flat, group=group)
        for out, buf, n in zip(tensor_list, bufs, sizes, strict=True):
            out.copy_(buf[:n].view(out.shape))
        return None

    dist.all_gather = all_gather


def _patch_megatron() -> None:
    from megatron_gspo.megatron.fallbacks import bind_missing_te_names

    bind_missing_te_names()  # also done by megatron_gspo.megatron.models.builder, on every device


def _check_versions() -> None:
    import megatron.core

    found = {"torch": torch.__version__, "megatron.core": megatron.core.__version__}
    for pkg, prefixes in TESTED_VERSIONS.items():
        if not any(found[pkg].startswith(p) for p in prefixes):
            warnings.warn(f"megatron_gspo.megatron.cpu is proven with {pkg} {prefixes}, "
                          f"found {found[pkg]}", stacklevel=3)
    if not hasattr(torch.overrides, "redispatch_function"):
        raise RuntimeError(f"torch {torch.__version__} lacks torch.overrides."
                           "redispatch_function; the CPU layer needs torch >= 2.13")


# ----------------------------------------------------------------------------- public API
def enable(trace: bool = False) -> bool:
    """Let Megatron-Core run on the CPU; no-op (returns False) when CUDA is available.

    Args:
        trace: log each rewrite once per call site (file:line).
    Returns:
        True when the CPU layer is active.
    """
    if torch.cuda.is_available():
        return False
    _state["trace"] = _state["trace"] or trace  # a later plain enable() keeps tracing on
    if _state["enabled"]:
        return True
    _check_versions()
    _install_cuda_stand_ins()
    _patch_all_to_all_single()
    _patch_megatron()
    torch.Tensor.type = _patched_type(torch.Tensor.type)
    torch._dynamo.config.disable = True
    mode = _CudaToCpuMode()
    mode.__enter__()  # process-global: stays active for the life of the process
    _state.update(enabled=True, mode=mode)
    return True


def enabled() -> bool:
    """True when `enable()` activated the CPU layer in this process."""
    return _state["enabled"]


def device() -> torch.device:
    """The device the learner computes on: cuda:<current> on GPU, cpu otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
