"""SGLang's real CPU server (tier `sglang_real`) on a block-wise FP8 checkpoint (DeepSeek-V3
format, arXiv 2412.19437; written by megatron_gspo/quant/fp8_checkpoint.py) of a tiny Qwen3.

Finding (2026-12, SGLang 0.5.12 and 0.5.23, this repository's CPU installs): the server parses
the quantization_config and loads every FP8 weight and `weight_scale_inv`, then refuses in
`Fp8LinearMethod.process_weights_after_loading_block_quant`:
  0.5.23  sglang/srt/layers/quantization/fp8.py:827
  0.5.12  sglang/srt/layers/quantization/fp8.py:494
  AssertionError: Fp8LinearMethod on CPU requires that CPU has AMX support
(`cpu_has_amx_support()` = AMX tiles in the CPU and sgl-kernel's CPU op `convert_weight_packed`;
the CUDA sglang-kernel wheel of scripts/sglang_cpu.sh has no such op, so even an AMX CPU fails).
The MoE method asserts the same ("Fp8MoEMethod on CPU requires that CPU has AMX support").
The test holds the finding: a refusal other than this one fails it; a server that starts
instead is checked against transformers on our dequantized weights (W8A8 on the server:
dynamic FP8 activations, hence the loose bound)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from tests.rollout import _sglang_real as tier

tier.require_tier()
pytestmark = pytest.mark.sglang_real

from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams  # noqa: E402
from megatron_gspo.rollout.sglang.client import SGLangEngine  # noqa: E402

REFUSAL = "Fp8LinearMethod on CPU requires that CPU has AMX support"


def _fp8_qwen3(d):
    """A tiny Qwen3 whose fused q/k/v and gate/up parts are multiples of 128 rows (SGLang's
    block FP8 needs whole blocks per merged part), with the tiny example's tokenizer, and its
    FP8 copy. Returns (bf16 dir, fp8 dir)."""
    import transformers

    from megatron_gspo.quant.fp8_checkpoint import write_fp8_checkpoint

    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=128, intermediate_size=384,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, head_dim=32, eos_token_id=2,
                                   pad_token_id=3, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(d / "bf16")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tier.TINY / f, d / "bf16" / f)
    write_fp8_checkpoint(d / "bf16", d / "fp8")
    return d / "bf16", d / "fp8"


def _refusal(log: str) -> tuple[str, str] | None:
    """(SGLang file:line, error line) of the traceback's last frame, None without one."""
    err = re.findall(r"^(\w+Error: .*)$", log, re.M)
    frames = re.findall(r'File "[^"]*/site-packages/(sglang/[^"]+)", line (\d+)', log)
    return (f"{frames[-1][0]}:{frames[-1][1]}", err[-1]) if err and frames else None


def test_fp8_checkpoint_serves_or_refuses_with_the_known_amx_error(tmp_path):
    from megatron_gspo.quant.fp8_checkpoint import dequantized_state

    bf16, fp8 = _fp8_qwen3(tmp_path)
    qc = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [128, 128]
    logs = tmp_path / "logs"
    eng = SGLangEngine(launch=tier.spec(fp8, "bfloat16", tier.API_KEY, str(logs)),
                       startup_timeout_s=900, request_timeout_s=120, vocab_size=128,
                       backoff_s=0.05)
    try:
        try:
            eng.sync(eng.astart())
        except RolloutError as e:
            log = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log")))
            where = _refusal(log)
            assert where is not None and where[1] == f"AssertionError: {REFUSAL}", (
                f"SGLang {tier.version()} failed on the FP8 checkpoint otherwise: {e}; "
                f"{where}")
            assert where[0].startswith("sglang/srt/layers/quantization/fp8.py:")
            assert "Loading safetensors" in log or "loading shards" in log.lower()
            print(f"\nSGLang {tier.version()} CPU: block FP8 refused at {where[0]}: {where[1]}")
            return
        sp = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, ignore_eos=True)
        prompts = [[5, 9, 12, 7], [20, 21, 22], [40, 3, 3, 17, 60]]
        samples = eng.generate([GenerateRequest(p, sp) for p in prompts])
    finally:
        eng.shutdown()
    net = tier.hf_model(bf16, dequantized_state(fp8, torch.float32))
    mine = tier.recompute(net, [(s.prompt_ids, s.response_ids) for s in samples])
    diffs = [abs(a - b) for s, m in zip(samples, mine, strict=True)
             for a, b in zip(s.rollout_logprobs, m, strict=True)]
    print(f"\nSGLang {tier.version()} CPU serves block FP8: served vs dequantized recompute "
          f"over {len(diffs)} tokens: max {max(diffs):.3g} mean {sum(diffs) / len(diffs):.3g}")
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.5
