"""Weight-sync payloads: SGLang's serialized flattened-bucket format round trip."""

from __future__ import annotations

import base64

import pytest
import torch

from megatron_gspo.rollout.weight_sync import (
    FlattenedTensorMetadata,
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


def test_flatten_layout_matches_sglang_metadata():
    named = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(4))]
    payload = flatten_bucket(named)
    flat, metas = payload["flattened_tensor"], payload["metadata"]
    assert flat.shape == (10,)
    m = metas[1]
    assert (m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) == (
        "b", (4,), torch.float32, 6, 10, 4)
    obj = deserialize(serialize(payload))
    assert [x for x, _ in unflatten_bucket(obj)] == ["a", "b"]


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
    bad = {"flattened_tensor": torch.zeros(3), "metadata": [
        FlattenedTensorMetadata("x", torch.Size([4]), torch.float32, 0, 4, 4)]}
    with pytest.raises(ValueError, match="bad index range for x"):
        unflatten_bucket(bad)
    assert dtype_name(torch.bfloat16) == "bfloat16"
