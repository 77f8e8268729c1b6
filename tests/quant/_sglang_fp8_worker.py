"""Run with an SGLang venv's python (tests/quant/test_blockfp8_sglang.py): SGLang's own block-FP8
functions on the inputs of IN.pt, results to OUT.pt.

  quantize: sglang.srt.layers.quantization.mxfp8_block_convert.bf16_to_block_fp8_128
            ("the DeepSeek-V3 block-fp8 contract", pure torch; SGLang >= 0.5.2x, absent in 0.5.12)
  dequant:  sglang.srt.layers.quantization.fp8_utils.block_quant_dequant
  config:   sglang.srt.layers.quantization.fp8.Fp8Config.from_config of our quantization_config,
            and its `is_layer_skipped` for SGLang's (fused) module prefixes

Usage: python _sglang_fp8_worker.py IN.pt OUT.pt. A function that does not import is reported
as a string under its key ("missing: <error>")."""

import sys

import torch


def main(src: str, dst: str) -> None:
    inp = torch.load(src)
    out = {}
    try:
        import sglang

        out["version"] = sglang.__version__
    except Exception as e:  # noqa: BLE001
        out["version"] = f"unknown ({e})"
    try:
        from sglang.srt.layers.quantization.mxfp8_block_convert import bf16_to_block_fp8_128
    except Exception as e:  # noqa: BLE001
        out["quantize"] = f"missing: {type(e).__name__}: {e}"
    else:
        out["quantize"] = {k: bf16_to_block_fp8_128(w, block=128) for k, w in
                           inp["weights"].items()}
    try:
        from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
    except Exception as e:  # noqa: BLE001
        out["dequant"] = f"missing: {type(e).__name__}: {e}"
    else:
        out["dequant"] = {k: {str(dt): block_quant_dequant(q, s, [128, 128], dt)
                              for dt in (torch.float32, torch.bfloat16)}
                          for k, (q, s) in inp["ours"].items()}
    try:
        from sglang.srt.layers.quantization.fp8 import Fp8Config
        from sglang.srt.layers.quantization.utils import is_layer_skipped
    except Exception as e:  # noqa: BLE001
        out["config"] = f"missing: {type(e).__name__}: {e}"
    else:
        c = Fp8Config.from_config(inp["qc"])
        out["config"] = {
            "serialized": c.is_checkpoint_fp8_serialized, "block": c.weight_block_size,
            "activation_scheme": c.activation_scheme,
            "skipped": {p: is_layer_skipped(p, c.ignored_layers,
                                            fused_mapping=c.packed_modules_mapping)
                        for p in inp["prefixes"]}}
    torch.save(out, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
