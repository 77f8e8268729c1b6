"""`model.mtp_layers: add` and `algorithm.mtp_loss_weight` in the RL loop (issue 58 item 1;
`loop/mtp_setting.py`, `megatron/mtp_loss.py`):

- the tiny demo (Qwen3, no MTP layer): `megatron-gspo train ... model.mtp_layers=add
  algorithm.mtp_loss_weight=1` logs `mtp/loss`, `mtp/accuracy`, `mtp/tokens` every step; the run
  checkpoint holds the added layer; `convert mcore-to-hf` writes it under DeepSeek-V3's HF names
  (``model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}`` + a decoder layer + the
  embedding / head copies) with ``num_nextn_predict_layers: 1`` in config.json; transformers loads
  that export as a plain Qwen3 model (the extra tensors ignored: logits equal to the export
  without them); a run's learner on it as `model.path` keeps the layer (auto, trainable) and
  holds every tensor bit for bit; `hf-to-mcore` of it and `mcore-to-hf` back give every tensor
  bit for bit; a
  resumed run loads the layer and trains it further (its tensors move);
- DeepSeek-V3 with its checkpoint's MTP layer kept: trained when the weight is > 0 (the export's
  MTP tensors differ from the input's, where tests/loop/test_mtp_train.py shows them bit-exact at
  weight 0);
- under torchrun with 2 data-parallel ranks the `mtp/*` metrics equal the one-process run's;
- refusals, one line each: `add` on a checkpoint with MTP layers, a weight > 0 without MTP layers,
  `add` on a family whose MTP layers are not built, `add` with tensor parallelism or LoRA,
  `algorithm.mtp_lr` with the head frozen.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.loop.test_mtp_train import ENV, ROOT, _export, _model, _train

DEMO = ROOT / "examples" / "tiny" / "base"
SPEC = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
        "embed_tokens.weight", "shared_head.head.weight", "self_attn.q_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight")


def _convert(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "convert", *args,
                        "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]


def _load(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _plain_copy(src: Path, dst: Path, prefix: str) -> None:
    """`src` without its MTP tensors and config key (a plain transformers checkpoint)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({k: v for k, v in _load(src).items() if not k.startswith(prefix)},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("num_nextn_predict_layers")
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.slow
def test_add_trains_saves_exports_and_resumes_the_tiny_demo(tmp_path):
    import transformers

    run = tmp_path / "run"
    over = ("model.mtp_layers=add", "algorithm.mtp_loss_weight=1", "train.max_steps=3",
            "checkpoint.interval=3")
    out = _train(DEMO, run, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    print("\nadd + mtp_loss_weight 1 on the tiny demo: " + ", ".join(
        f"step {r['step']} mtp/accuracy {r['mtp/accuracy']:.3f} mtp/loss {r['mtp/loss']:.3f}"
        for r in rows))
    assert all(r["mtp/tokens"] > 0 and 0 <= r["mtp/accuracy"] <= 1 and r["mtp/loss"] > 0
               for r in rows)

    hf = tmp_path / "hf"
    got = _export(run, hf)
    n = json.loads((DEMO / "config.json").read_text())["num_hidden_layers"]
    p = f"model.layers.{n}."
    assert json.loads((hf / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert all(p + s in got for s in SPEC), sorted(k for k in got if k.startswith(p))
    src = _load(DEMO)
    assert sorted(k for k in got if not k.startswith(p)) == sorted(src)
    assert torch.equal(got[p + "embed_tokens.weight"], got["model.embed_tokens.weight"])
    assert torch.equal(got[p + "shared_head.head.weight"], got["lm_head.weight"])
    H = got[p + "eh_proj.weight"].shape[0]  # trained away from its [0 | I] start
    assert not torch.equal(got[p + "eh_proj.weight"][:, H:], torch.eye(H))

    # transformers: a plain Qwen3 model, the MTP tensors ignored
    _plain_copy(hf, tmp_path / "plain", p)
    x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for d in (hf, tmp_path / "plain"):
        m = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            logits.append(m(x).logits)
    assert torch.equal(*logits)

    # model.path = the export: auto keeps the layer, the learner loads every tensor bit for bit
    env = dict(ENV, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29731")
    worker = ROOT / "tests" / "megatron" / "_mtp_train_worker.py"
    r = subprocess.run([sys.executable, str(worker), str(tmp_path), str(hf), "readback"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = json.loads(r.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert r["mtp_params"] > 5 and r["names_equal"] and r["bit_exact"] and r["tensors"] == len(got)

    # hf-to-mcore and back: bit-exact, MTP layer included
    _convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc"))
    _convert("mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf2"))
    back = _load(tmp_path / "hf2")
    assert sorted(back) == sorted(got) and all(torch.equal(back[k], got[k]) for k in got)
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 1

    # resumed: the checkpoint's MTP layer loads and keeps training
    out = _train(DEMO, run, *over[:-2], "train.max_steps=4", "checkpoint.interval=4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3] and "mtp/accuracy" in _rows(run)[-1]
    again = _export(run, tmp_path / "hf_resumed")
    assert not torch.equal(again[p + "eh_proj.weight"], got[p + "eh_proj.weight"])


@pytest.mark.slow
def test_kept_deepseek_layer_is_trained_with_a_weight(tmp_path):
    model = _model(tmp_path / "model")
    run = tmp_path / "run"
    out = _train(model, run, "algorithm.mtp_loss_weight=1", "checkpoint.interval=2")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1] and all("mtp/accuracy" in r for r in rows)
    got = _export(run, tmp_path / "hf")
    src = _load(model)
    n = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    p = f"model.layers.{n}."
    own = [k for k in src if k.startswith(p) and "embed_tokens" not in k
           and "shared_head.head" not in k]
    moved = [k for k in own if not torch.equal(got[k], src[k])]
    print(f"\nDeepSeek-V3 kept MTP layer, weight 1: {len(moved)} of {len(own)} MTP tensors "
          f"trained; mtp/accuracy {[round(r['mtp/accuracy'], 3) for r in rows]}")
    assert len(moved) > 5 and sorted(got) == sorted(src)


@pytest.mark.parametrize("kind,over,msg", [
    ("mtp", "model.mtp_layers=add", "already has multi-token-prediction layers"),
    ("plain", "algorithm.mtp_loss_weight=1", "builds no MTP layer"),
    ("mtp", "model.mtp_layers=drop algorithm.mtp_loss_weight=0.5", "builds no MTP layer"),
    ("Gemma3ForCausalLM", "model.mtp_layers=add", "MTP layers are not built here"),
    ("demo", "model.mtp_layers=add parallel.tensor=2", "not supported yet"),
    ("demo", "model.mtp_layers=add model.lora.rank=4", "with model.lora are not supported"),
    ("demo", "model.mtp_layers=add algorithm.mtp_lr=1e-3", "mtp_loss_weight is 0"),
])
def test_add_and_weight_refusals_are_one_line(tmp_path, kind, over, msg):
    from megatron_gspo.config import ConfigError, load_config
    from megatron_gspo.loop.build import read_hf_config
    from megatron_gspo.loop.mtp_setting import mtp_layers
    from tests.convert.tiny_families import make_family_model

    if kind == "demo":
        model = DEMO
    elif kind in ("mtp", "plain"):
        model = _model(tmp_path / "model", mtp=kind == "mtp")
    else:
        model = tmp_path / "model"
        make_family_model(kind, model)
    cfg = load_config(None, [f"model.path={model}", *over.split()])
    with pytest.raises(ConfigError, match=msg) as e:
        mtp_layers(cfg, read_hf_config(str(model)))
    assert "\n" not in str(e.value)
    if kind == "demo":  # add alone is accepted, and declares the layer
        from megatron_gspo.loop.mtp_setting import run_config

        ok = load_config(None, [f"model.path={model}", "model.mtp_layers=add",
                                "algorithm.mtp_loss_weight=1"])
        hf = read_hf_config(str(model))
        assert mtp_layers(ok, hf) is True and run_config(ok, hf)["num_nextn_predict_layers"] == 1


@pytest.mark.slow
def test_data_parallel_mtp_metrics_equal_one_process(tmp_path):
    """Under torchrun with 2 data-parallel ranks the head's loss and metrics (reduced over DP) are
    the one-process run's: mtp/tokens and mtp/accuracy equal, mtp/loss within 1e-6."""
    over = ("model.mtp_layers=add", "algorithm.mtp_loss_weight=1", "train.max_steps=2",
            "train.prompts_per_step=4", "rollout.group_size=4", "checkpoint.interval=0",
            "train.eval_interval=0", "logging.progress_bar=false", "logging.tensorboard=false",
            "logging.log_samples=0")
    runs = {}
    for n in (1, 2):
        run = tmp_path / f"dp{n}"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
               "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
               "-m", "megatron_gspo.cli", "train", str(ROOT / "examples/tiny/config.yaml"),
               "--run-dir", str(run), *over]
        out = subprocess.run(cmd, cwd=ROOT, env=dict(ENV, OMP_NUM_THREADS="1"),
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        runs[n] = _rows(run)
    for a, b in zip(runs[1], runs[2], strict=True):
        print(f"\nstep {a['step']}: mtp/loss {a['mtp/loss']:.7f} (1 process) "
              f"{b['mtp/loss']:.7f} (DP2), mtp/accuracy {a['mtp/accuracy']:.4f} / "
              f"{b['mtp/accuracy']:.4f}")
        assert a["mtp/tokens"] == b["mtp/tokens"] and a["mtp/accuracy"] == b["mtp/accuracy"]
        assert abs(a["mtp/loss"] - b["mtp/loss"]) < 1e-6 * a["mtp/loss"]
        assert a["reward/mean"] == b["reward/mean"]
