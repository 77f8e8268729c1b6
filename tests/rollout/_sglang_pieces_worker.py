"""Runs with SGLang 0.5.12's Python pieces on the path (scripts/sglang_pieces.sh): checks our
weight payloads against SGLang's own MultiprocessingSerializer / SafeUnpickler /
FlattenedTensorBucket and its CUDA reduction patch; prints one JSON line for
tests/rollout/test_sglang_real_pieces.py."""

import importlib.machinery
import io
import json
import pathlib
import pickle
import sys
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler


def _stub_torchvision() -> None:
    """sglang.srt.utils imports torchvision.io.decode_jpeg (images only); stand a stub in when
    no torchvision matching this torch is installed."""
    try:
        import torchvision.io  # noqa: F401
        return
    except Exception:  # noqa: BLE001 - absent or built for another torch
        pass
    for name in ("torchvision", "torchvision.io"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
    sys.modules["torchvision.io"].decode_jpeg = None
    sys.modules["torchvision"].io = sys.modules["torchvision.io"]


@dataclass
class OldMeta:  # a learner-side metadata class, as our payloads used to pickle
    name: str


def main() -> None:
    _stub_torchvision()
    import torch
    from sglang.srt.utils import MultiprocessingSerializer, SafeUnpickler
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    from megatron_gspo.rollout import weight_sync_payloads as ws

    g = torch.Generator().manual_seed(0)
    named = [("w.bf16", torch.randn(5, 3, generator=g).bfloat16()),
             ("n.fp32", torch.randn(7, generator=g)),
             ("v.bf16", torch.randn(3, generator=g).bfloat16())]
    fp32 = [named[1]]
    out: dict = {"sglang_importable": ws.sglang_importable()}

    def server_rebuild(entry):  # tp_worker.py + model_runner._update_weights_from_flattened_bucket
        obj = MultiprocessingSerializer.deserialize(entry)
        metas = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype,
                                         start_idx=m.start_idx, end_idx=m.end_idx,
                                         numel=m.numel) for m in obj["metadata"]]
        return FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"],
                                     metadata=metas).reconstruct_tensors()

    def same(pairs, ref):
        ref = dict(ref)
        return sorted(n for n, _ in pairs) == sorted(ref) and all(
            t.dtype == ref[n].dtype and torch.equal(t, ref[n]) for n, t in pairs)

    # SGLang's own payload (made before its patch) decodes with the stand-in's decoder.
    b = FlattenedTensorBucket(named_tensors=fp32)
    entry = MultiprocessingSerializer.serialize(
        {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()},
        output_str=True)
    out["standin_decodes_sglang"] = same(ws.decode_tensor_update(
        {"serialized_named_tensors": [entry], "load_format": "flattened_bucket"}), fp32)

    monkey_patch_torch_reductions()  # global from now on, as in a process that imported sglang
    try:
        ForkingPickler(io.BytesIO()).dump(torch.zeros(2))
        out["plain_cpu_dump_after_patch"] = "ok"
    except Exception as e:  # noqa: BLE001 - the fact under test
        out["plain_cpu_dump_after_patch"] = type(e).__name__

    bodies, _ = ws.tensor_update_payloads(named, tp_size=2)
    got = [p for body in bodies for k in (0, 1)
           for p in server_rebuild(body["serialized_named_tensors"][k]) if k == 0]
    out["sglang_decodes_ours"] = same(got, named) and len(bodies) == 2
    out["metadata_module"] = type(ws.flatten_bucket(fp32)["metadata"][0]).__module__

    real = ws._sglang
    ws._sglang = lambda: None  # the payload a learner without sglang builds
    try:
        payload = ws.flatten_bucket(fp32)
        out["fallback_metadata_module"] = type(payload["metadata"][0]).__module__
        out["sglang_decodes_fallback"] = same(server_rebuild(ws.serialize(payload)), fp32)
    finally:
        ws._sglang = real

    samples = {"OldMeta": OldMeta("x"), "SimpleNamespace": types.SimpleNamespace(a=1),
               "PurePosixPath": pathlib.PurePosixPath("/x"), "OrderedDict": {"a": 1},
               "torch.Size": torch.Size([2, 3]), "dtype": torch.bfloat16}
    agree = {}
    for name, obj in samples.items():
        data = pickle.dumps(obj)
        verdicts = []
        for loader in (SafeUnpickler, ws.AllowListUnpickler):
            try:
                loader(io.BytesIO(data)).load()
                verdicts.append(True)
            except Exception:  # noqa: BLE001 - refusal is the verdict
                verdicts.append(False)
        agree[name] = verdicts
    out["allow_list"] = agree
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
