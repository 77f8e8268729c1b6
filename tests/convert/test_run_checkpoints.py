"""`mcore-to-hf` converts the trainer's own run checkpoints (runs/<name>/checkpoints/step_N).

One worker launch (tests/convert/_run_ckpt_worker.py, 4 gloo processes) trains one step and
saves through `Checkpointer.save` under TP2xPP2 (tied embeddings), PP2xEP2 (MoE) and PP2xVPP2
with the distributed optimizer (DP2). Each checkpoint is converted to HF (given as the step
directory, the run directory, or the step's model/ folder; under other conversion layouts),
and transformers' log-probs of the batch equal the learner's after its step.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from tests.convert._run_ckpt_worker import CASES, samples

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from convert_checkpoint import main  # noqa: E402

STEP = "checkpoints/step_00000001"


@pytest.fixture(scope="module")
def runs(tiny_hf, tmp_path_factory):
    work = tmp_path_factory.mktemp("runs")
    args = {"hf_dirs": {a: str(d) for a, d in tiny_hf.items()}, "work": str(work)}
    p = subprocess.run(
        [sys.executable, "-W", "ignore", str(Path(__file__).with_name("_run_ckpt_worker.py")),
         json.dumps(args)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    for case, (arch, _, _) in CASES.items():  # the model section of the trainer's config.yaml
        (work / case / "config.yaml").write_text(
            yaml.safe_dump({"model": {"path": str(tiny_hf[arch])}}))
    return work


def _cli(*argv):
    p = subprocess.run(
        [sys.executable, "-W", "ignore", str(ROOT / "tools" / "convert_checkpoint.py"), *argv,
         "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _hf_logprobs(model_dir: Path) -> list[list[float]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for s in samples():
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            lp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            pos = torch.arange(len(s.prompt_ids) - 1, ids.shape[1] - 1)
            out.append(lp[pos, ids[0, pos + 1]].tolist())
    return out


HOW = {
    # case: (what --ckpt points at, extra arguments)
    "tied_tp2_pp2": (STEP, []),
    "moe_pp2_ep2": ("", ["--ep", "2"]),  # the run directory: its newest complete checkpoint
    "llama_pp2_vpp2_dp2": (STEP + "/model", ["--tp", "2", "--hf-config", None]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_run_checkpoint_converts_and_logprobs_match(runs, tiny_hf, tmp_path, case):
    arch = CASES[case][0]
    where, extra = HOW[case]
    extra = [str(tiny_hf[arch]) if a is None else a for a in extra]
    out = tmp_path / "hf"
    _cli("mcore-to-hf", "--ckpt", str(runs / case / where), "--out", str(out), *extra)
    assert (out / "tokenizer_config.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch]
    ref = torch.load(runs / case / "logprobs.pt")
    got = _hf_logprobs(out)
    moved = max(abs(a - b) for x, y in zip(ref["logprobs"], ref["before"], strict=True)
                for a, b in zip(x, y, strict=True))
    assert moved > 1e-3  # the step changed the model: the HF model has the trained weights
    for g, w in zip(got, ref["logprobs"], strict=True):
        err = (torch.tensor(g, dtype=torch.float64) - torch.tensor(w, dtype=torch.float64))
        assert err.abs().max() <= 2e-5, (g, w)


@pytest.mark.slow
def test_damaged_or_incomplete_run_checkpoint_is_refused(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs / "tied_tp2_pp2", run)
    step = run / STEP
    shard = sorted((step / "model").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    rc = main(["mcore-to-hf", "--ckpt", str(step), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and shard.name in err and "sha256" in err, err
    (step / "COMPLETE").unlink()
    rc = main(["mcore-to-hf", "--ckpt", str(step), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "COMPLETE" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_run_checkpoint_config_sources_and_checks(runs, tiny_hf, tmp_path, capsys):
    from megatron_gspo.convert.param_map import ConversionError
    from megatron_gspo.convert.sources import MODEL_INFO
    from megatron_gspo.megatron.io import conversion as conv

    arch = CASES["tied_tp2_pp2"][0]
    run = tmp_path / "run"
    shutil.copytree(runs / "tied_tp2_pp2", run)
    step = run / STEP
    # the learner stored its config: a --hf-config that differs from it is refused
    cfg_dir = tmp_path / "cfg"
    shutil.copytree(tiny_hf[arch], cfg_dir)
    cfg = json.loads((cfg_dir / "config.json").read_text())
    (cfg_dir / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    with pytest.raises(ConversionError, match="rms_norm_eps"):
        conv.check_mcore_to_hf(str(step), str(cfg_dir), str(tmp_path / "o"), False)
    plan = conv.check_mcore_to_hf(str(step), None, str(tmp_path / "o"), False)
    assert plan["hf_config"]["rms_norm_eps"] == cfg["rms_norm_eps"]
    assert plan["side_dir"] == str(tiny_hf[arch])  # tokenizer files from the run's model.path
    # a checkpoint without a stored config (older learner): the run's model.path config.json
    (step / "model" / MODEL_INFO).unlink()
    marker = json.loads((step / "COMPLETE").read_text())
    del marker["files"]["model/" + MODEL_INFO]
    (step / "COMPLETE").write_text(json.dumps(marker))
    plan = conv.check_mcore_to_hf(str(step), None, str(tmp_path / "o"), False)
    assert plan["hf_config"] == json.loads((tiny_hf[arch] / "config.json").read_text())
    assert "model.path" in capsys.readouterr().err
    # ... still checked against the tensor shapes
    (cfg_dir / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    with pytest.raises(ConversionError, match="num_hidden_layers"):
        conv.check_mcore_to_hf(str(step), str(cfg_dir), str(tmp_path / "o"), False)
    # ... and with no config.yaml either, --hf-config is required
    (run / "config.yaml").unlink()
    with pytest.raises(ConversionError, match="--hf-config"):
        conv.check_mcore_to_hf(str(step), None, str(tmp_path / "o"), False)
