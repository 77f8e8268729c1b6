"""Weight-sync payloads: SGLang's byte-layout flattened bucket, its unpickler allow-list, CPU
payloads after SGLang's CUDA reduction patch, and buckets for tensors above the size bound."""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass

import pytest
import torch

from megatron_gspo.rollout import weight_sync_payloads as weight_sync
from megatron_gspo.rollout.weight_sync_payloads import (
    decode_tensor_update,
    deserialize,
    dtype_name,
    flatten_bucket,
    serialize,
    tensor_update_payloads,
    unflatten_bucket,
)


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g).bfloat16()),
        ("model.norm.weight", torch.randn(8, generator=g)),
        ("lm_head.weight", torch.randn(16, 8, generator=g).bfloat16()),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(4, 8, generator=g)),
    ]


def test_flattened_payload_round_trip_per_dtype():
    named = _named()
    bodies, keep = tensor_update_payloads(named, tp_size=2)
    assert len(bodies) == 2 and len(keep) == 2  # one flattened bucket per dtype
    got = []
    for body in bodies:
        assert body["load_format"] == "flattened_bucket"
        entries = body["serialized_named_tensors"]
        assert len(entries) == 2 and all(isinstance(e, str) for e in entries)
        base64.b64decode(entries[0], validate=True)
        for rank in (0, 1):
            pairs = decode_tensor_update(body, tp_rank=rank)
            if rank == 0:
                got += pairs
    assert [n for n, _ in got] == ["model.embed_tokens.weight", "lm_head.weight",
                                   "model.norm.weight", "model.layers.0.mlp.up_proj.weight"]
    ref = dict(named)
    for n, t in got:
        assert t.dtype == ref[n].dtype and torch.equal(t, ref[n])


def test_flatten_uses_sglang_byte_layout():
    """SGLang tensor_bucket.py: uint8 bytes, byte offsets, rebuilt by .view(dtype).reshape."""
    named = [("a", torch.arange(6.0, dtype=torch.bfloat16).reshape(2, 3)),
             ("b", torch.ones(4, dtype=torch.bfloat16))]
    payload = flatten_bucket(named)
    flat, metas = payload["flattened_tensor"], payload["metadata"]
    assert flat.dtype == torch.uint8 and flat.shape == (20,)
    m = metas[1]
    assert (m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) == (
        "b", (4,), torch.bfloat16, 12, 20, 8)
    # The server's rebuild, written out: bytes -> dtype -> shape.
    a = flat[metas[0].start_idx:metas[0].end_idx].view(metas[0].dtype).reshape(metas[0].shape)
    assert torch.equal(a, named[0][1])
    obj = deserialize(serialize(payload))
    assert [(x, t.tolist()) for x, t in unflatten_bucket(obj)] == [
        (n, t.tolist()) for n, t in named]
    with pytest.raises(ValueError, match="uint8"):  # an element-offset payload is refused
        unflatten_bucket({"flattened_tensor": torch.zeros(10), "metadata": metas})


_Refused = getattr(weight_sync, "WeightSyncError", ())  # what the allow-list raises


@dataclass
class _ForeignMeta:  # a class outside SGLang's allow-list, like a learner-side dataclass
    name: str


def test_server_unpickler_allow_list():
    """SGLang's SafeUnpickler refuses classes outside its allow-list; so does the stand-in."""
    buf = io.BytesIO()
    pickle.dump({"flattened_tensor": torch.zeros(4, dtype=torch.uint8),
                 "metadata": [_ForeignMeta("x")]}, buf)
    with pytest.raises(_Refused, match=r"Blocked unsafe class loading .*_ForeignMeta"):
        deserialize(base64.b64encode(buf.getvalue()).decode())
    with pytest.raises(_Refused, match=r"posix\.system"):
        deserialize(pickle.dumps(__import__("os").system))
    payload = flatten_bucket(_named()[:1])  # our own payloads pass
    assert [n for n, _ in unflatten_bucket(deserialize(serialize(payload)))] == [
        "model.embed_tokens.weight"]


def _sglang_like_patch():
    """The effect of SGLang's `monkey_patch_torch_reductions()` (srt/utils/patch_torch.py):
    the global tensor reduction rewrites argument 6 (the CUDA device) of every reduced tensor,
    which CPU tensors do not have. Returns an undo function."""
    from torch.multiprocessing import reductions

    original = reductions.reduce_tensor

    def patched(*args, **kwargs):
        fn, out = original(*args, **kwargs)
        return fn, (*out[:6], str(out[6]), *out[7:])

    reductions._reduce_tensor_original = original
    reductions.reduce_tensor = patched
    reductions.init_reductions()

    def undo():
        reductions.reduce_tensor = original
        del reductions._reduce_tensor_original
        reductions.init_reductions()

    return undo


def test_cpu_payloads_survive_sglang_reduction_patch():
    from multiprocessing.reduction import ForkingPickler

    undo = _sglang_like_patch()
    try:
        with pytest.raises(IndexError):  # what the patch does to a plain CPU dump
            ForkingPickler(io.BytesIO()).dump(torch.zeros(3))
        bodies, _ = tensor_update_payloads(_named(), tp_size=1)
        pairs = [p for b in bodies for p in decode_tensor_update(b)]
        assert len(pairs) == 4
    finally:
        undo()


def test_plain_named_tensors_and_errors():
    named = _named()[:2]
    bodies, _ = tensor_update_payloads(named, tp_size=1, flattened=False)
    assert bodies[0]["load_format"] is None
    pairs = decode_tensor_update(bodies[0])
    assert [n for n, _ in pairs] == [n for n, _ in named]
    with pytest.raises(ValueError, match="one dtype"):
        flatten_bucket(named)
    with pytest.raises(ValueError, match="empty"):
        flatten_bucket([])
    with pytest.raises(ValueError, match="one entry per TP rank"):
        one = bodies[0]["serialized_named_tensors"][:1]
        decode_tensor_update({"serialized_named_tensors": one}, tp_rank=1)
    good = flatten_bucket([("x", torch.zeros(4))])
    good["metadata"][0].end_idx = 20
    with pytest.raises(ValueError, match="bad byte range for x"):
        unflatten_bucket(good)
    assert dtype_name(torch.bfloat16) == "bfloat16"


def test_tensor_above_bucket_bound_travels_alone():
    """A tensor bigger than rollout.bucket_bytes (Qwen3-1.7B's embedding vs 512 MiB) gets a
    bucket of its own instead of failing the sync."""
    from megatron_gspo.megatron.io.weight_export import bucketize

    t = {n: torch.zeros(k, dtype=torch.uint8) for n, k in
         [("a", 30), ("b", 30), ("big", 250), ("c", 60), ("d", 50)]}
    buckets = [[n for n, _ in b] for b in bucketize(iter(t.items()), bucket_bytes=100)]
    assert buckets == [["a", "b"], ["big"], ["c"], ["d"]]
    sizes = [sum(t[n].numel() for n in b) for b in buckets]
    assert max(s for b, s in zip(buckets, sizes, strict=True) if b != ["big"]) <= 100
