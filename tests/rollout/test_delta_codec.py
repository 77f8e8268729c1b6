"""The delta encoding (rollout/delta/codec.py) and the server's loader (gspo_delta_loader.py):
exact bit for bit after applying, the smallest encoding per tensor, and the refusals that keep
a delta off an unknown base."""

from __future__ import annotations

import ast
import zlib
from pathlib import Path

import pytest
import torch

from megatron_gspo.rollout.delta import gspo_delta_loader as L
from megatron_gspo.rollout.delta.codec import encode_tensor, file_pairs, pack, write_file
from megatron_gspo.rollout.delta.sender import DeltaSender


def _changed(base: torch.Tensor, share: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    m = torch.rand(base.shape, generator=g) < share
    new[m] = (base.float()[m] * (1 + 1e-2 * torch.randn(int(m.sum()), generator=g))
              ).to(base.dtype)
    return new


class _Model:
    """What SGLang hands the loader: an object with load_weights(pairs)."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for n, t in weights:
            self.loaded[n] = t.clone()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float8_e4m3fn])  # FP8 rollouts send e4m3 weights
@pytest.mark.parametrize("share", [0.0, 0.002, 0.05, 0.4, 1.0])
def test_every_encoding_applies_bit_for_bit(dtype, share):
    base = torch.randn(300, 70).to(dtype)
    new = _changed(base, share)
    model = _Model()
    L.load(model, pack([encode_tensor("w", None, base)], None, "s:1"))
    enc = encode_tensor("w", base, new)
    L.load(model, pack([enc], "s:1", "s:2"))
    assert _same_bits(model.loaded["w"], new) if enc.kind != "same" else _same_bits(base, new)
    assert _same_bits(model._gspo_delta_state.base["w"], new)
    assert enc.nbytes <= new.numel() * new.element_size()


def test_choice_per_tensor_is_the_smallest():
    base = torch.randn(4096, 64).to(torch.bfloat16)
    assert encode_tensor("w", base, base.clone()).kind == "same"
    sparse = encode_tensor("w", base, _changed(base, 0.01))
    assert sparse.kind == "sparse" and sparse.nbytes == sparse.changed * 6
    dense = _changed(base, 0.6)  # small relative changes: the XOR's high bits are zeros
    xor = encode_tensor("w", base, dense)
    assert xor.kind == "xor" and xor.nbytes < min(xor.changed * 6, base.numel() * 2)
    g = torch.Generator().manual_seed(3)  # random bit patterns: nothing compresses, full wins
    noise = torch.randint(-2**15, 2**15, (4096, 64), generator=g, dtype=torch.int16).view(
        torch.bfloat16)
    assert encode_tensor("w", base, noise).kind == "full"
    assert encode_tensor("w", base, dense, xor_min_share=1.1).kind in ("sparse", "full")
    ints = torch.arange(10)
    assert encode_tensor("i", ints, ints + 1).kind == "full"  # not a float: always whole


def test_signed_zero_and_nan_payloads_count_as_changes():
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.float32)
    new = base.clone()
    new[0] = -0.0
    new.view(torch.int32)[2] = base.view(torch.int32)[2] + 1  # another NaN payload
    enc = encode_tensor("w", base, new)
    assert enc.changed == 2
    model = _Model()
    L.load(model, pack([encode_tensor("w", None, base)], None, "a"))
    L.load(model, pack([enc], "a", "b"))
    assert _same_bits(model.loaded["w"], new)


def test_a_delta_on_an_unknown_base_is_refused_and_changes_nothing():
    base = torch.randn(64, 8)
    new = _changed(base, 0.1)
    fresh = _Model()  # a restarted server: no base at all
    with pytest.raises(RuntimeError, match="full sync is needed"):
        L.load(fresh, pack([encode_tensor("w", base, new)], "s:1", "s:2"))
    assert not fresh.loaded
    model = _Model()
    L.load(model, pack([encode_tensor("w", None, base)], None, "s:1"))
    with pytest.raises(RuntimeError, match="holds 's:1'"):  # a base the server never saw
        L.load(model, pack([encode_tensor("w", base, new)], "s:0", "s:2"))
    model.load_weights([("other", torch.ones(2))])  # a plain load (another path) drops the base
    with pytest.raises(RuntimeError, match="full sync is needed"):
        L.load(model, pack([encode_tensor("w", base, new)], "s:1", "s:2"))
    L.load(model, pack([encode_tensor("w", None, new)], None, "s:3"))  # a full sync is taken
    assert _same_bits(model.loaded["w"], new)


def test_later_buckets_of_one_sync_and_a_refused_bucket():
    a, b = torch.randn(32, 4), torch.randn(16)
    model = _Model()
    L.load(model, pack([encode_tensor("a", None, a)], None, "s:1"))
    L.load(model, pack([encode_tensor("b", None, b)], None, "s:1"))  # 2nd bucket, same sync
    a2, b2 = _changed(a, 0.2), _changed(b, 0.2, seed=1)
    L.load(model, pack([encode_tensor("a", a, a2)], "s:1", "s:2"))
    L.load(model, pack([encode_tensor("b", b, b2)], "s:1", "s:2"))
    assert _same_bits(model.loaded["a"], a2) and _same_bits(model.loaded["b"], b2)
    with pytest.raises(RuntimeError, match="continues on base"):
        L.load(model, pack([encode_tensor("b", b2, b)], "s:0", "s:2"))


def test_delta_file_is_applied(tmp_path):
    base = torch.randn(50, 6).to(torch.bfloat16)
    new = _changed(base, 0.3)
    model = _Model()
    L.load(model, pack([encode_tensor("w", None, base)], None, "a"))
    path = str(tmp_path / "d.pt")
    assert write_file(path, pack([encode_tensor("w", base, new)], "a", "b")) > 0
    L.load(model, file_pairs(path))
    assert _same_bits(model.loaded["w"], new)


def test_loader_imports_only_torch_and_the_standard_library():
    import sys

    tree = ast.parse(Path(L.__file__).read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
            for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and n.module}
    assert mods - {"torch", "__future__"} <= set(sys.stdlib_module_names), mods


def test_sender_full_then_delta_then_forced_full():
    w = {"a": torch.randn(1000, 100).to(torch.bfloat16), "b": torch.randn(40).to(torch.bfloat16)}
    s = DeltaSender("on")
    model = _Model()
    st = s.begin(1)
    L.load(model, s.encode(list(w.items())))
    s.commit()
    s.finish(True)
    assert (st.delta, st.reason) == (False, "first sync") and st.kinds["full"] == 2
    w2 = {"a": _changed(w["a"], 0.01), "b": w["b"].clone()}
    st = s.begin(2)
    pairs = s.encode(list(w2.items()))
    L.load(model, pairs)
    s.commit()
    s.finish(True)
    assert st.delta and st.kinds["same"] == 1 and st.kinds["sparse"] == 1
    assert st.bytes_sent < st.bytes_full / 20 and 0 < st.share() < 0.01
    assert all(_same_bits(s.base[k], w2[k]) for k in w2)
    assert _same_bits(model._gspo_delta_state.base["a"], w2["a"])
    assert s.base_bytes() == sum(t.numel() * 2 for t in w.values())
    s.invalidate("sync probe mismatch")
    st = s.begin(3)
    assert (st.delta, st.reason) == (False, "sync probe mismatch")
    auto = DeltaSender("auto", threshold=0.5)
    auto.acked_version, auto.invalid_reason, auto.last_share = 1, None, 0.7
    assert auto.begin(2).reason.startswith("changed share 0.7")
    auto.last_share = 0.1
    assert auto.begin(2).delta


def test_hash_base_skips_unchanged_tensors():
    w = [("a", torch.randn(30)), ("b", torch.randn(20))]
    s = DeltaSender("on", base="hash")
    s.begin(1)
    assert [n for n, _ in s.encode(w)] == ["a", "b"]
    s.commit()
    s.finish(True)
    assert s.base_bytes() == 2 * 64
    s.begin(2)
    sent = s.encode([("a", w[0][1] + 1), ("b", w[1][1].clone())])
    assert [n for n, _ in sent] == ["a"] and s.stats.kinds["same"] == 1


def test_xor_bytes_are_zlib_of_the_bit_xor():
    base = torch.randn(1000).to(torch.bfloat16)
    new = _changed(base, 0.9)
    enc = encode_tensor("w", base, new)
    assert enc.kind == "xor"
    x = (new.view(torch.int16) ^ base.view(torch.int16)).numpy().tobytes()
    assert zlib.decompress(enc.parts[0].numpy().tobytes()) == x


def test_config_reads_on_and_off_though_yaml_makes_them_booleans():
    from megatron_gspo.config import load_config
    from megatron_gspo.config.schema import ConfigError

    root = Path(__file__).resolve().parents[2]
    for text, want in (("on", "on"), ("off", "off"), ("auto", "auto")):
        cfg = load_config(root / "examples" / "tiny" / "config.yaml",
                          ["rollout.engine=sglang", f"rollout.weight_sync_delta={text}"])
        assert cfg.rollout.weight_sync_delta == want
    with pytest.raises(ConfigError, match="rollout.weight_sync_delta"):
        load_config(root / "examples" / "tiny" / "config.yaml",
                    ["rollout.engine=sglang", "rollout.weight_sync_delta=1"])
    with pytest.raises(ConfigError, match="rollout.dtype: expected str"):  # no on/off choices
        load_config(root / "examples" / "tiny" / "config.yaml", ["rollout.dtype=on"])
    with pytest.raises(ConfigError, match="rollout.weight_sync_delta: for SGLang engines"):
        load_config(root / "examples" / "tiny" / "config.yaml",
                    ["rollout.engine=embedded", "rollout.weight_sync_delta=on"])


def test_a_request_lives_on_one_device():
    base = torch.randn(64, 8).to(torch.bfloat16)
    enc = encode_tensor("w", base, _changed(base, 0.05))
    enc.parts = [p.to("meta") for p in enc.parts]  # as a CUDA export would have them
    pairs = pack([enc], "a", "b")
    assert {t.device.type for _, t in pairs} == {"meta"}
    assert {t.device.type for _, t in pack([encode_tensor("w", base, _changed(base, 0.05))],
                                           "a", "b")} == {"cpu"}
