"""The device-memory ledger's model of one GPU (runtime/device_ledger.py): torch's caching
allocator (freed bytes stay with the process until empty_cache), torch_memory_saver's release
and resume of SGLang's regions (fresh memory on resume, content only with a CPU backup, exit(1)
when cuMemCreate fails), SGLang's KV sizing from the driver's free memory at launch; and its
spec from `megatron-gspo plan`."""

import json
from pathlib import Path

import pytest

from megatron_gspo.runtime.device_ledger import (DeviceLedger, DeviceOutOfMemory, LedgerSpec,
                                             sglang_kv_tokens)

G = 2**30
ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "examples" / "qwen3_gpu"
ALL = {"weights": True, "grads": True, "main": True, "moments": True, "reference": False}
NONE = dict.fromkeys(ALL, False)


def _spec(**kw):
    sizes = {"CUDA contexts, NCCL": 3 * G, "learner weights": 8 * G, "gradient buffer": 16 * G,
             "main weights": 4 * G, "optimizer moments": 8 * G, "KL reference": 0,
             "activations": 4 * G, "logits / log-probs": 8 * G, "SGLang weights": 16 * G,
             "SGLang CUDA graphs": 2 * G, "weight-sync bucket": 1 * G}
    args = dict(name="t", gpu_bytes=80 * G, sizes=sizes, plan_moments={}, plan_kv_tokens=None,
                mem_fraction=0.75, kv_cell_bytes=2**20)
    args.update(kw)
    return LedgerSpec(**args)


def test_freed_learner_bytes_stay_with_the_process_until_empty_cache():
    led = DeviceLedger(_spec())
    led.set_learner(ALL)
    assert led.total() == (3 + 36) * G
    led.set_learner(NONE)  # storages resized to 0: torch keeps the blocks cached
    assert led.total() == (3 + 36) * G and led.cached == 36 * G
    with led.transient("activations"):  # served from the cache, no new device memory
        assert led.total() == (3 + 36) * G
    led.empty_cache()
    assert led.total() == 3 * G and led.cached == 0


def test_kv_cache_is_sized_from_what_the_driver_has_free_at_launch():
    free = 77 * G  # 80 - contexts: the learner offloaded and its cache returned
    want = sglang_kv_tokens(free, 16 * G, 0.75, 2**20)
    led = DeviceLedger(_spec(plan_kv_tokens=want))
    led.set_learner(ALL)
    led.set_learner(NONE)
    led.empty_cache()
    led.sglang_launch()
    assert led.kv_tokens == want and not led.problems
    late = DeviceLedger(_spec(plan_kv_tokens=want))  # offloaded, cache not returned
    late.set_learner(ALL)
    late.set_learner(NONE)
    late.sglang_launch()
    assert late.kv_tokens == sglang_kv_tokens(free - 36 * G, 16 * G, 0.75, 2**20) < want
    assert "SGLang sizes its KV cache" in late.problems[0]


def test_resume_into_a_full_gpu_is_the_servers_out_of_memory():
    led = DeviceLedger(_spec(strict=True))
    led.sglang_launch()
    led.sglang_release(None)
    led.set_learner(ALL)
    led.moment("weight sync")
    with pytest.raises(DeviceOutOfMemory, match=r"weight sync: resume kv_cache needs .* GiB"):
        led.sglang_resume(["weights"])  # fits: 3 + 36 + 16 = 55 GiB
        led.sglang_resume(["kv_cache"])
    soft = DeviceLedger(_spec())  # not strict: recorded, the run goes on
    soft.sglang_launch()
    soft.set_learner(ALL)
    assert soft.problems and soft.report()["problems"]


def test_released_weights_come_back_only_with_a_cpu_backup_or_a_full_sync():
    for backup in (False, True):
        led = DeviceLedger(_spec(weights_cpu_backup=backup))
        led.sglang_launch()
        led.sglang_release(["kv_cache", "cuda_graph"])
        led.sglang_resume(["kv_cache", "cuda_graph"])
        led.generating()
        assert not led.problems
        led.sglang_release(None)
        led.sglang_resume(None)
        led.sglang_weights_sent(False)  # LoRA's partial sync: adapted layers only
        led.generating()
        assert bool(led.problems) is not backup
        led.sglang_weights_sent(True)
        n = len(led.problems)
        led.generating()
        assert len(led.problems) == n


def test_report_compares_each_moment_with_the_plan():
    led = DeviceLedger(_spec(plan_moments={"training": int(55 * G), "weight sync": 28 * G}))
    led.moment("training")
    led.set_learner(ALL)
    with led.transient("activations", "logits / log-probs"):
        pass
    led.moment("weight sync")
    rep = led.report()
    rows = {r["moment"]: r for r in rep["moments"]}
    assert rows["training"]["peak_bytes"] == (3 + 36 + 12) * G
    assert any("training: peak 51.00 GiB, plan 55.00 GiB" in p for p in rep["problems"])
    assert any("weight sync" in p for p in rep["problems"])  # 51 GiB held on entry vs 28


@pytest.mark.parametrize("config,shape,nodes", [
    ("qwen3_8b_1node", "Qwen3-8B", 1), ("qwen3_30b_a3b_1node", "Qwen3-30B-A3B", 1),
    ("qwen3_30b_a3b_2nodes", "Qwen3-30B-A3B", 2)])
def test_plan_writes_the_ledger_spec_with_every_moment(tmp_path, capsys, config, shape, nodes):
    from megatron_gspo.cli import main

    out = tmp_path / "spec.json"
    assert main(["plan", str(GPU / f"{config}.yaml"), "--model-config",
                 str(GPU / "shapes" / shape), "--gpu-memory", "80GB", "--nodes", str(nodes),
                 "--ledger-spec", str(out)]) == 0
    text = capsys.readouterr().out
    spec = json.loads(out.read_text())
    assert spec["name"] == config and spec["gpu_bytes"] == 80 * 10**9
    assert set(spec["plan_moments"]) == {"start-up", "resume", "generation", "training",
                                         "weight sync", "checkpoint", "sync probe"}
    assert all(b < spec["gpu_bytes"] * 0.95 for b in spec["plan_moments"].values())
    assert "pinned host memory" in text
    for m in ("start-up", "resume", "checkpoint", "sync probe"):
        assert m in text
