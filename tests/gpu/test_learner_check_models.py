"""scripts/gpu_learner_check.py's GPU case: the dense model runs first and each model passes or
fails on its own (an MoE failure, e.g. a missing Transformer Engine name, must not hide the
dense comparison)."""

from __future__ import annotations

import megatron_gspo.megatron.learner as learner_mod
import megatron_gspo.megatron.models.builder as model_mod
import tests.megatron._gpu_extra as _gpu_extra
import tests.megatron._workers as workers


def test_each_model_fails_on_its_own_dense_first(monkeypatch, tmp_path):
    calls = []

    class Broken:
        def __init__(self, hf, **kw):
            name = "moe" if hf.get("num_experts") else "dense"
            calls.append(name)
            raise NameError(f"{name}: stand-in failure")

    monkeypatch.setattr(learner_mod, "Learner", Broken)
    monkeypatch.setattr(_gpu_extra, "check_grads_finite_cuda", lambda chk, info: None)  # CUDA
    monkeypatch.setattr(model_mod, "te_available", lambda: False)
    monkeypatch.setattr(workers.torch, "load", lambda *a, **k: {"dense": {}, "moe": {}})
    chk, info = workers.Checker(), {}
    workers.case_gpu(tmp_path, chk, info)
    assert calls == ["dense", "moe"]
    assert info["models"] == {"dense": "FAIL", "moe": "FAIL"}
    assert [f.splitlines()[0] for f in chk.failures] == ["dense: exception:", "moe: exception:"]


def test_one_failing_model_leaves_the_other_ok():
    chk, info, ran = workers.Checker(), {}, []

    def one(name, hf):
        ran.append(name)
        if name == "moe":
            raise NameError("name 'te_general_gemm' is not defined")

    workers.each_model(chk, info, one)
    assert ran == ["dense", "moe"] and info["models"] == {"dense": "ok", "moe": "FAIL"}
    assert "te_general_gemm" in chk.failures[0]
