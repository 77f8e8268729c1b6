"""Run with an SGLang venv's python (tests/rollout/test_sglang_fp8_launch.py): SGLang's own
`prepare_server_args` and `ModelConfig` read an FP8 server's command line as our launcher builds
it, with the environment `loop/fp8_rollout.server_env` gives Blackwell servers; prints
"RESULT {...}": the release, the FP8 flags as parsed, the quantization the model config takes
from the checkpoint's config.json, and SGLang's DeepGEMM switch under that environment.

Usage: python _sglang_fp8_launch_worker.py ARGV_JSON (the arguments after `-m MODULE`)."""

import json
import sys


def main(argv: list[str]) -> None:
    import sglang
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.environ import envs
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    mc = ModelConfig.from_server_args(args)
    print("RESULT " + json.dumps({
        "version": sglang.__version__, "quantization_flag": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype, "fp8_gemm_backend": args.fp8_gemm_runner_backend,
        "moe_runner_backend": args.moe_runner_backend, "model_quantization": mc.quantization,
        "model_dtype": str(mc.dtype), "deepgemm_enabled": envs.SGLANG_ENABLE_JIT_DEEPGEMM.get()}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
