"""The delta loader against replayed and malformed buckets (issue 54, defect 6): a bucket a
sync already applied is not applied again (an XOR or sparse delta on its own result reverts the
weights, and the next delta would land on the wrong base), every part is checked against the
manifest before anything is decoded, and XOR bytes inflate with a bound."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from megatron_gspo.rollout.delta import gspo_delta_loader as L
from megatron_gspo.rollout.delta.codec import encode_tensor, pack


class _Model:
    """What SGLang hands the loader: an object with load_weights(pairs)."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for n, t in weights:
            self.loaded[n] = t.clone()


def _tweak(t: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    m = torch.rand(t.shape, generator=g) < share
    out[m] += 1e-2 * torch.randn(int(m.sum()), generator=g)
    return out


@pytest.fixture
def served():
    """A model loaded with a full sync 's1' of one [64, 64] fp32 tensor, and that tensor."""
    w1 = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    model = _Model()
    L.load(model, pack([encode_tensor("w", None, w1)], None, "s1"))
    return model, w1


def _bits(t):
    return t.reshape(-1).view(torch.int32)


@pytest.mark.parametrize("share", [0.5, 0.01])  # xor, sparse
def test_a_replayed_delta_bucket_is_not_applied_twice(served, share):
    model, w1 = served
    w2 = _tweak(w1, share, 1)
    bucket = pack([encode_tensor("w", w1, w2)], "s1", "s2")
    kind = json.loads(bytes(bucket[0][1].numpy().tobytes()))["tensors"][0]["kind"]
    assert kind == ("xor" if share == 0.5 else "sparse")
    model.load_weights(bucket)
    model.load_weights(bucket)  # a retrying client or proxy sends it again
    assert torch.equal(_bits(model.loaded["w"]), _bits(w2))  # not reverted to w1
    w3 = _tweak(w2, share, 2)
    model.load_weights(pack([encode_tensor("w", w2, w3)], "s2", "s3"))
    assert torch.equal(_bits(model.loaded["w"]), _bits(w3))  # the next delta on the right base


def test_another_bucket_naming_a_loaded_tensor_is_refused(served):
    model, w1 = served
    w2 = _tweak(w1, 0.5, 1)
    model.load_weights(pack([encode_tensor("w", w1, w2)], "s1", "s2"))
    other = pack([encode_tensor("v", None, torch.ones(3)),
                  encode_tensor("w", w1, _tweak(w1, 0.5, 7))], "s1", "s2")
    with pytest.raises(RuntimeError, match="already loaded w in another bucket"):
        model.load_weights(other)
    assert "v" not in model.loaded
    assert torch.equal(_bits(model.loaded["w"]), _bits(w2))


def _tampered(w1, kind, edit):
    """A delta bucket on 's1' of `kind` whose manifest and data `edit(manifest, data)` changes."""
    share = {"sparse": 0.01, "xor": 0.5, "full": 1.0}[kind]
    enc = encode_tensor("w", None if kind == "full" else w1, _tweak(w1, share, 3))
    assert enc.kind == kind
    pairs = pack([enc], "s1", "s2")
    manifest = json.loads(bytes(pairs[0][1].numpy().tobytes()))
    data = [t for _, t in pairs[1:]]
    edit(manifest, data)
    text = json.dumps(manifest).encode()
    return [(L.MANIFEST, torch.frombuffer(bytearray(text), dtype=torch.uint8))] + [
        (f"{L.PREFIX}{k}", t) for k, t in enumerate(data)]


def _set(i, value):
    def edit(manifest, data):
        data[i] = value(data[i])
    return edit


BOMB = zlib.compress(bytes(200 * 2**20), 9)  # about 200 KB that inflate to 200 MiB


@pytest.mark.parametrize("kind, edit, says", [
    ("sparse", _set(1, lambda v: v[:1]), "sparse values"),  # 8+ indices, 1 value: broadcast
    ("sparse", _set(0, lambda i: torch.cat([i[:-1], torch.tensor([-1], dtype=i.dtype)])),
     "sparse index outside"),
    ("sparse", _set(0, lambda i: torch.cat([i[:-1], torch.tensor([4096], dtype=i.dtype)])),
     "sparse index outside"),
    ("sparse", _set(1, lambda v: v.double()), "sparse values torch.float64"),
    ("sparse", _set(0, lambda i: i.float()), "sparse index of torch.float32"),
    ("full", _set(0, lambda v: v.double()), "full values torch.float64"),
    ("full", _set(0, lambda v: v.reshape(-1)[:100]), "full values torch.float32 x 100"),
    ("xor", _set(0, lambda b: torch.frombuffer(bytearray(BOMB), dtype=torch.uint8)),
     "inflate to more than 16384 bytes, the tensor has 16384"),
    ("xor", _set(0, lambda b: b[: len(b) // 2]), "inflate to"),  # truncated stream
    ("xor", _set(0, lambda b: torch.tensor([1, 2, 3], dtype=torch.uint8)), "not zlib data"),
    ("xor", lambda m, d: d.append(torch.zeros(3)), "the manifest uses data parts [0]"),
    ("xor", lambda m, d: m["tensors"][0].update(parts=[5]), "data parts [5]"),
    ("xor", lambda m, d: m["tensors"].append(dict(m["tensors"][0])), "one tensor twice"),
])
def test_a_malformed_part_is_refused_and_nothing_changes(served, kind, edit, says):
    model, w1 = served
    bucket = _tampered(w1, kind, edit)
    with pytest.raises(RuntimeError, match="gspo_delta_loader") as e:
        model.load_weights(bucket)
    assert says in str(e.value), str(e.value)
    assert torch.equal(_bits(model.loaded["w"]), _bits(w1))
    assert torch.equal(_bits(model._gspo_delta_state.base["w"]), _bits(w1))
    w2 = _tweak(w1, 0.5, 4)  # the served weights and their base still take a delta
    model.load_weights(pack([encode_tensor("w", w1, w2)], "s1", "s2"))
    assert torch.equal(_bits(model.loaded["w"]), _bits(w2))
