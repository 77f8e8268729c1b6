"""`model.mtp_layers` (issue 55, item 2; `loop/mtp_setting.py`) on a tiny DeepSeek-V3 checkpoint
WITH its multi-token-prediction layer (tests/convert/tiny_mtp.py):

- `megatron-gspo train` keeps it by default (auto): 2 GSPO steps, the run checkpoint holds the
  MTP layer, and `convert mcore-to-hf` of that checkpoint gives the input's MTP tensors bit for
  bit (frozen through training) while the trained main weights moved; the embedding / head
  copies equal the exported (trained) main tensors; a resumed third step loads and keeps it;
- the learner the run builds holds it frozen: no trainable MTP parameter, none in the optimizer;
- weight sync (`loop.weight_sync_phase.sync_weights` into a recording engine; DeepSeek-V3 and
  GLM-4.5): to SGLang servers launched with a draft (``--speculative-algorithm``), a full sync
  carries the MTP layer's own tensors (bit-exact, not the embedding / head copies) and a delta
  sync after a training step leaves them out (unchanged); the embedded engine (no draft) gets
  none; the KL reference is built without them;
- `drop` builds none (the run checkpoint and its export have none), and the refusals are one
  line each (keep/drop on a checkpoint without MTP, keep under tensor parallelism, with LoRA,
  on a family whose MTP layers are not built).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.convert.tiny_families import FAMILIES, make_family_model
from tests.convert.tiny_mtp import make_mtp_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "tiny" / "base"
ARCH = "DeepseekV3ForCausalLM"
REWARD = "def reward(text, label, meta):\n    return len(set(text)) / 8.0\n"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2",
           CUDA_VISIBLE_DEVICES="")


def _model(out: Path, mtp: bool = True, arch: str = ARCH) -> Path:
    if mtp:
        make_mtp_checkpoint(arch, out)
    else:
        make_family_model(arch, out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((TOKENIZER / f).read_bytes())
    return out


def _train(model: Path, run: Path, *over: str) -> subprocess.CompletedProcess:
    (run.parent / "rw.py").write_text(REWARD)
    args = [f"model.path={model}", f"reward.name={run.parent / 'rw.py'}:reward",
            "train.max_steps=2", "train.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "algorithm.mini_batches=2", "optimizer.lr=1e-2",
            "checkpoint.interval=0", "train.eval_interval=0", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.log_samples=0", *over]
    return subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "train",
                           str(ROOT / "examples/tiny/config.yaml"), "--run-dir", str(run),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=ENV)


def _export(run: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]  # the newest
    r = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "convert", "mcore-to-hf",
                        "--ckpt", str(ckpt), "--out", str(out), "--no-progress"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    sd = {}
    for f in sorted(out.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


@pytest.mark.slow  # tests/loop/test_mtp_add_train.py's refusals and the sync runs stay default
def test_train_keeps_the_mtp_layer_frozen_in_checkpoint_and_export(tmp_path):
    model = _model(tmp_path / "model")
    from safetensors.torch import load_file

    src = load_file(str(model / "model.safetensors"))
    run = tmp_path / "run"
    out = _train(model, run)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["grad_norm"] > 0 for r in rows)
    got = _export(run, tmp_path / "hf")
    n = FAMILIES[ARCH][1]["num_hidden_layers"]
    p = f"model.layers.{n}."
    assert sorted(got) == sorted(src)  # every tensor of the input, MTP layer included
    own = [k for k in src if k.startswith(p) and "embed_tokens" not in k
           and "shared_head.head" not in k]
    assert len(own) > 10 and all(torch.equal(got[k], src[k]) for k in own)
    moved = [k for k in src if not k.startswith(p) and not torch.equal(got[k], src[k])]
    print(f"\nMTP kept: {len(own)} MTP tensors bit-exact after 2 steps; {len(moved)} of "
          f"{len(src) - len([k for k in src if k.startswith(p)])} main tensors trained")
    assert len(moved) > 10
    assert torch.equal(got[p + "embed_tokens.weight"], got["model.embed_tokens.weight"])
    assert torch.equal(got[p + "shared_head.head.weight"], got["lm_head.weight"])

    out = _train(model, run, "train.max_steps=3")  # resumed: the checkpoint loads the MTP layer
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    again = _export(run, tmp_path / "hf_resumed")
    assert all(torch.equal(again[k], src[k]) for k in own)
    assert any(not torch.equal(again[k], got[k]) for k in moved)  # step 2 trained

    run2 = tmp_path / "run_drop"
    out = _train(model, run2, "model.mtp_layers=drop")
    assert out.returncode == 0, out.stderr[-3000:]
    got = _export(run2, tmp_path / "hf_drop")
    assert not any(k.startswith(p) for k in got) and len(got) == len(src) - len(own) - 2


def _sync(model: Path, over: dict, port: int) -> dict:
    env = dict(ENV, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_mtp_sync_worker.py")),
                          str(model), json.dumps(over)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])


@pytest.mark.parametrize("arch", [ARCH, pytest.param("Glm4MoeForCausalLM",
                                                marks=pytest.mark.slow)])
def test_sync_sends_the_mtp_layer_to_servers_with_a_draft_only(tmp_path, arch):
    model = _model(tmp_path / "model", arch=arch)
    n = FAMILIES[arch][1]["num_hidden_layers"]
    p = f"model.layers.{n}."
    spec = {"rollout.engine": "sglang", "rollout.colocate": "false",
            "rollout.weight_sync": "distributed", "rollout.verify_sync_interval": 0,
            "rollout.extra_server_args": "[--speculative-algorithm, NEXTN]",
            "rollout.weight_sync_delta": "on", "rollout.weight_sync_delta_base": "hash"}
    r = _sync(model, spec, 29611)
    names = r["checkpoint_names"]
    own = {k for k in names if k.startswith(p) and "embed_tokens" not in k
           and "shared_head.head" not in k}
    assert r["mtp_params"] > 0 and r["mtp_trainable"] == 0 and r["mtp_in_optimizer"] == 0
    assert set(r["first"]) == set(names) - {p + "embed_tokens.weight",
                                            p + "shared_head.head.weight"}
    assert r["first_mtp_equal_input"]
    assert r["second"] and not any(k.startswith(p) for k in r["second"])  # unchanged: skipped
    print(f"\n{arch} sync with a draft: full {len(r['first'])} tensors ({len(own)} MTP), "
          f"delta after a step {len(r['second'])} (0 MTP)")
    r = _sync(model, {"algorithm.kl_coef": 0.05}, 29612)  # the embedded engine: no draft
    assert r["mtp_params"] > 0 and not any(k.startswith(p) for k in r["first"])
    assert r["reference"] and r["reference_mtp_params"] == 0  # the KL reference: policy only
    print(f"KL reference vs initial policy log-probs: {r['reference_diff']:.2g}")
    assert r["reference_diff"] < 1e-5  # loaded as the initial policy
    assert set(r["first"]) == set(names) - {k for k in names if k.startswith(p)}


@pytest.mark.parametrize("mtp,over,msg", [
    (False, "model.mtp_layers=keep", "has no multi-token-prediction layer"),
    (False, "model.mtp_layers=drop", "has no multi-token-prediction layer"),
    (True, "parallel.tensor=2", "not supported yet"),
    (True, "model.lora.rank=4", "with model.lora are not supported"),
    ("Gemma3ForCausalLM", "model.mtp_layers=keep", "MTP layers are not built here"),
])
def test_refusals_are_one_line(tmp_path, mtp, over, msg):
    from megatron_gspo.config import ConfigError, load_config
    from megatron_gspo.loop.build import read_hf_config
    from megatron_gspo.loop.mtp_setting import mtp_layers

    if isinstance(mtp, str):  # another family
        model = tmp_path / "model"
        make_family_model(mtp, model)
    else:
        model = _model(tmp_path / "model", mtp=mtp)
    cfg = load_config(None, [f"model.path={model}", over])
    with pytest.raises(ConfigError, match=msg) as e:
        mtp_layers(cfg, read_hf_config(str(model)))
    assert "\n" not in str(e.value) and str(e.value).startswith("model.mtp_layers")
    if mtp is False:  # auto on a checkpoint without MTP: nothing to keep, no error
        assert mtp_layers(load_config(None, [f"model.path={model}"]),
                          read_hf_config(str(model))) is False
