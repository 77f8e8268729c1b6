"""`convert lora-to-peft` of routed-expert adapters (issue 55 item 5): a LoRA run checkpoint of
the tiny Qwen3-MoE with adapters on qkv, proj and the routed experts (random B) is written as a
PEFT adapter (experts through peft's `target_parameters` on transformers 5's fused expert
tensors) that `peft` loads onto the base with the merged model's logits; targets peft cannot
load on an MoE model are refused in one line before any weight is read."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.convert.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from convert_checkpoint import main  # noqa: E402

STEP = "checkpoints/step_00000001"


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("lora_moe")
    base, run = work / "base", work / "run"
    make_tiny_model("Qwen3MoeForCausalLM", base)
    p = subprocess.run([sys.executable, "-W", "ignore",
                        str(Path(__file__).with_name("_lora_ckpt_worker.py")), str(base),
                        str(run), "qkv,proj,experts"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return run, base


def test_expert_adapters_export_to_peft_and_load_with_the_merged_logits(moe_run, tmp_path,
                                                                         capsys):
    import transformers
    from peft import PeftModel

    run, base = moe_run
    out, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["lora-to-peft", "--ckpt", str(run / STEP), "--out", str(out),
                 "--merged", str(merged)]) == 0, capsys.readouterr().err
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert conf["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    ids = torch.tensor([[5, 17, 3, 42, 9, 28, 61, 7]])
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(merged).float().eval()(ids)
        pm = PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base).float().eval(), str(out))
        got = pm.eval()(ids).logits
        with pm.disable_adapter():
            off = pm(ids).logits
    err = (got - want.logits).abs().max().item()
    print(f"peft vs merged logits: {err:.2e}, adapters off: "
          f"{(off - want.logits).abs().max().item():.2e}")
    assert err <= 1e-5
    assert (off - want.logits).abs().max().item() > 1e-3  # the experts' adapters matter


def test_targets_peft_cannot_load_on_an_moe_model_are_refused_before_reading(moe_run, tmp_path,
                                                                             capsys, monkeypatch):
    from megatron_gspo.megatron.lora import io as lora_io

    monkeypatch.setattr(lora_io, "peft_rewriting_moe_mlp", lambda: "0.21.2")  # an older peft
    run, _ = moe_run
    info_path = run / STEP / "model" / "lora.json"
    info = json.loads(info_path.read_text())
    bad = tmp_path / "run"  # a copy whose lora.json names a shared-experts target
    subprocess.run(["cp", "-r", str(run), str(bad)], check=True)
    info["targets"] = ["qkv", "experts", "shared_experts"]
    text = json.dumps(info).encode()
    (bad / STEP / "model" / "lora.json").write_bytes(text)
    complete = json.loads((bad / STEP / "COMPLETE").read_text())  # re-sealed: size, sha256
    complete["files"]["model/lora.json"] = [len(text), hashlib.sha256(text).hexdigest()]
    (bad / STEP / "COMPLETE").write_text(json.dumps(complete))
    rc = main(["lora-to-peft", "--ckpt", str(bad / STEP), "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "shared experts" in err and "_convert_peft_config_moe" in err
    assert not (tmp_path / "a").exists()
