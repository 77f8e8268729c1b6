"""SGLang version differences, in one place (supported: 0.5.12 through 0.5.23).

The client, launcher and weight sync write against one protocol and ask this module where
releases differ; nothing else branches on the SGLang version. Each difference names the
upstream file that changed (paths under python/sglang/srt/):

- Weight-update sessions (managers/scheduler_components/weight_updater.py, 0.5.23): tensor
  and distributed weight updates are refused ("must run between begin_weight_update() and
  end_weight_update()") outside a session opened by `POST /begin_weight_update` and closed by
  `POST /end_weight_update` (entrypoints/http_server.py). 0.5.12 has neither endpoint and
  answers 404: `UPDATE_SESSION_PATHS`, `lacks_update_sessions` (the engine remembers the
  answer per server, so no version is read).
- Memory release on the CPU engine (managers/scheduler_components/weight_updater.py:379 in
  0.5.23, managers/scheduler_update_weights_mixin.py:156 in 0.5.12): `release_memory_occupation`
  ends with `torch.get_device_module().synchronize()`. Under torch 2.11 (0.5.12's pin) that is
  `torch.cpu` on a machine without a GPU; under torch 2.14.1 (0.5.23's pin) `torch/__init__.py`
  `get_device_module` takes `torch._C._accelerator_getAccelerator()`, the build's accelerator,
  so a CUDA build gives `torch.cuda` and the call raises "Found no NVIDIA driver": the scheduler
  dies and the server exits. A CPU-engine server has no memory saver (torch_memory_saver needs
  CUDA; the launcher leaves --enable-memory-saver out), so on 0.5.12 release and resume free
  nothing. `sends_memory_calls` says which servers get them: none that reports device "cpu".
- Request ids refused before the scheduler (managers/tokenizer_manager.py): 0.5.12 keeps for
  good the rid of a request refused for its length; 0.5.23 releases it
  (`_release_req_states_on_failure`). The client sends a fresh rid per attempt: neither matters.
- The unpickler of weight payloads (utils/common.py `SafeUnpickler`, which decodes every
  `serialized_named_tensors` entry; a refused global raises in the scheduler and ends the
  server): 0.5.12 loads any global of an allowed module prefix (torch., sglang.srt.utils.,
  ...; `weight_sync.prefix_refusal`); 0.5.23 loads only an exact list of (module, name)
  globals (`EXACT_GLOBALS`; `torch.storage._load_from_bytes` is replaced by a safe loader).
  `unpickler_refusal` picks the rule of the release a server reports (`/server_info` version);
  a server that reports none, or one between the two, gets both.
- The draft on the distributed path (speculative decoding): 0.5.12
  managers/scheduler_update_weights_mixin.py `update_weights_from_distributed` loads the
  broadcast into the target only (sglang #27718); 0.5.23 managers/scheduler_components/
  weight_updater.py loads it into the draft runners too (sglang #28575):
  `distributed_reaches_draft`. Tensor and disk updates reach the draft in both.
- Reading the draft's weights: 0.5.23's `/weights_checker` (`CheckWeightsReqInput.selector`)
  returns checksums of the draft runners' tensors (keys `draft.<name>`); 0.5.12's reads the
  target only (`sglang.draft_probe` asks every drafting server and checks what it returns).
- The range itself (`SUPPORTED`, `version_warning`): a server outside it is served but logged.

Not a difference: `UpdateWeightsFromTensorReqInput.torch_empty_cache` (managers/io_struct.py)
exists in both releases and is read only when the same request sets `flush_cache`
(scheduler_update_weights_mixin.py `flush_cache_after_weight_update` in 0.5.12,
scheduler_components/weight_updater.py in 0.5.23); the weight sync posts its buckets with
`flush_cache` false and ends with `/flush_cache`, whose `Scheduler.flush_cache(empty_cache=True)`
empties the server's allocator cache in both (0.5.23 through
scheduler_components/flush_wrapper.py), then `/continue_generation`, whose
`ContinueGenerationReqInput.torch_empty_cache` defaults to true in both (scheduler.py
`continue_generation` empties it again). So after the loads of every sync, full or delta, the
allocator cache is returned before colocated servers resume their KV cache, on every supported
release, and no request carries the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from megatron_gspo.rollout.weight_sync_payloads import prefix_refusal

#: Oldest and newest SGLang release tested (README "Supported versions"; the sglang_real tier
#: runs against both, scripts/sglang_cpu/lock-<version>.txt).
SUPPORTED = ("0.5.12", "0.5.23")

#: Opening and closing of a weight-update session (SGLang 0.5.23 entrypoints/http_server.py).
UPDATE_SESSION_PATHS = ("/begin_weight_update", "/end_weight_update")


def lacks_update_sessions(error: Exception) -> bool:
    """True when `error` (the client's RolloutError of `POST /begin_weight_update`) is the 404
    of a release without weight-update sessions (0.5.12); any other failure is a real one."""
    return "answered HTTP 404" in str(error)


def sends_memory_calls(server_info: dict) -> bool:
    """Whether `/release_memory_occupation` and `/resume_memory_occupation` go to the server of
    this `/server_info`: not to SGLang's CPU engine (`device` "cpu"), which has no memory to
    release and which they end on 0.5.23 (see the module docstring)."""
    return server_info.get("device") != "cpu"


#: First release whose distributed weight update reaches the draft (and whose /weights_checker
#: reads it).
DRAFT_FANOUT_FROM = (0, 5, 23)


def distributed_reaches_draft(server_info: dict) -> bool:
    """Whether `update_weights_from_distributed` of the server of this `/server_info` loads the
    broadcast into its draft model too (see the module docstring): from 0.5.23; False for a
    server that reports no release."""
    got = _release(str(server_info.get("version", "")))
    return got is not None and got >= DRAFT_FANOUT_FROM


def _release(text: str) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(x) for x in m.groups()) if m else None


def version_warning(server_info: dict) -> str | None:
    """A one-line note when the server's `version` is an SGLang release outside `SUPPORTED`
    (None inside it, and for servers that report no release, e.g. the stand-in)."""
    got = _release(str(server_info.get("version", "")))
    if got is None:
        return None
    low, high = (_release(v) for v in SUPPORTED)
    assert low is not None and high is not None
    if low <= got <= high:
        return None
    return (f"SGLang {server_info['version']} is outside the tested range {SUPPORTED[0]} to "
            f"{SUPPORTED[1]} (megatron_gspo/rollout/sglang/versions.py)")


#: First release whose `SafeUnpickler` loads an exact list of globals (`EXACT_GLOBALS`).
EXACT_UNPICKLER_FROM = (0, 5, 23)
_TENSORS = ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short")
_STORAGES = ("BFloat16", "Bool", "Byte", "Char", "ComplexDouble", "ComplexFloat", "Double",
             "Float", "Half", "Int", "Long", "Short")
_DTYPES = (
    "bcomplex32 bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf "
    "complex128 complex32 complex64 double float float16 float32 float4_e2m1fn_x2 float64 "
    "float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half int int1 "
    "int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 long qint32 qint8 quint2x4 quint4x2 "
    "quint8 short uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8 "
    "per_tensor_affine per_tensor_symmetric per_channel_affine per_channel_symmetric "
    "per_channel_affine_float_qparams Tensor Size device dtype UntypedStorage").split()
_REBUILD = ("_rebuild_tensor _rebuild_tensor_v2 _rebuild_tensor_v3 _rebuild_parameter "
            "_rebuild_parameter_with_state _rebuild_qtensor _rebuild_sparse_tensor "
            "_rebuild_meta_tensor_no_storage _rebuild_wrapper_subclass "
            "_rebuild_device_tensor_from_numpy _rebuild_device_tensor_from_cpu_tensor").split()
_REDUCTIONS = ("rebuild_tensor rebuild_meta_tensor rebuild_cuda_tensor rebuild_nested_tensor "
               "rebuild_sparse_coo_tensor rebuild_sparse_compressed_tensor rebuild_storage_fd "
               "rebuild_storage_filename rebuild_storage_empty rebuild_typed_storage "
               "rebuild_typed_storage_child").split()
#: SGLang 0.5.23 utils/common.py `SafeUnpickler.ALLOWED_GLOBALS` (and `_load_from_bytes`).
EXACT_GLOBALS = frozenset({
    *(("builtins", n) for n in ("bool bytearray bytes complex dict float frozenset int list "
                                "range set slice str tuple").split()),
    *(("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")),
    ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"), ("functools", "partial"),
    ("itertools", "chain"), ("itertools", "repeat"), ("types", "SimpleNamespace"),
    ("multiprocessing.reduction", "_rebuild_partial"),
    ("multiprocessing.reduction", "_rebuild_socket"),
    ("multiprocessing.resource_sharer", "DupFd"), ("_codecs", "encode"),
    *(("torch", n) for n in _DTYPES),
    *((m, t + "Tensor") for m in ("torch", "torch.cuda") for t in _TENSORS),
    *((m, t + "Tensor") for m in ("torch.sparse", "torch.cuda.sparse") for t in _TENSORS
      if t != "Bool"),
    *(("torch", s + "Storage") for s in _STORAGES + ("QInt32", "QInt8", "QUInt2x4", "QUInt4x2",
                                                     "QUInt8")),
    *(("torch.cuda", s + "Storage") for s in _STORAGES),
    ("torch.nn.parameter", "Parameter"), ("torch.serialization", "_get_layout"),
    *(("torch._utils", n) for n in _REBUILD), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "_UntypedStorage"),
    ("torch.storage", "TypedStorage"), ("torch.storage", "_load_from_bytes"),
    *(("torch.multiprocessing.reductions", n) for n in _REDUCTIONS),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    ("sglang.srt.utils.patch_torch", "_rebuild_npu_tensor_modified"),
    ("torch_npu.multiprocessing.reductions", "rebuild_npu_tensor"),
    ("sglang.srt.managers.io_struct", "GenerateReqInput"),
    ("sglang.srt.managers.io_struct", "EmbeddingReqInput"),
    ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
    ("sglang.srt.managers.schedule_batch", "Modality"),
    ("sglang.srt.multimodal.modality", "Modality"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
    ("sglang.srt.model_executor.model_runner_components.weight_updater",
     "LocalSerializedTensor"),
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
})


def exact_refusal(module: str, name: str) -> str | None:
    """Why SGLang 0.5.23's `SafeUnpickler` refuses the global `module.name`, or None."""
    if (module, name) in EXACT_GLOBALS:
        return None
    return (f"Blocked unsafe global ({module}.{name}) during pickle deserialization: not in "
            "SGLang 0.5.23's SafeUnpickler allow-list")


def _both(module: str, name: str) -> str | None:
    return prefix_refusal(module, name) or exact_refusal(module, name)


def unpickler_refusal(server_info: dict | None) -> Callable[[str, str], str | None]:
    """(module, name) -> why the server of this `/server_info` refuses that pickled global in
    a weight payload, or None (see the module docstring): 0.5.12's module prefixes up to
    0.5.12, 0.5.23's exact list from 0.5.23, both for a release between or none reported."""
    got = _release(str((server_info or {}).get("version", "")))
    if got is not None and got >= EXACT_UNPICKLER_FROM:
        return exact_refusal
    if got is not None and got <= _release(SUPPORTED[0]):
        return prefix_refusal
    return _both
