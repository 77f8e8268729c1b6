#!/usr/bin/env bash
# Install SGLang 0.5.12's Python pieces into an ignored folder for the optional real-SGLang test
# tier (tests/rollout/test_sglang_real_pieces.py): the sglang wheel and the small packages its
# `sglang.srt.utils` (MultiprocessingSerializer, SafeUnpickler, monkey_patch_torch_reductions)
# and `sglang.srt.weight_sync.tensor_bucket` import, all with --no-deps so the CPU torch of the
# environment stays as it is. Nothing is installed into the virtual environment itself.
#
# The second group of packages is what `sglang.srt.server_args` imports besides, for the tier
# that parses our launch command lines with SGLang's own ServerArgs
# (tests/rollout/test_sglang_real_args.py).
#
# Usage: scripts/sglang_pieces.sh [DIR]     (default .sglang-pieces in the repository root)
# Then:  .venv/bin/python -m pytest -m slow tests/rollout/test_sglang_real_pieces.py \
#            tests/rollout/test_sglang_real_args.py
# (the tests find DIR through MEGATRON_GSPO_SGLANG_PIECES, default .sglang-pieces).
#
# torchvision is not installed: sglang.srt.utils imports only its JPEG decoder, for images, and
# a build matching the CPU torch is not always published; the test worker stands a stub in for
# it when the real one is absent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/.sglang-pieces}
python=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$dir"
"$python" -m pip install --quiet --no-deps --upgrade --target "$dir" \
    sglang==0.5.12 orjson==3.13.0 pybase64==1.5.1 requests==2.34.2 urllib3==2.8.0 \
    certifi==2026.10.19.post1 starlette==1.10.0 triton==3.9.0 ipython==9.18.1 traitlets==5.16.1
"$python" -m pip install --quiet --no-deps --upgrade --target "$dir" \
    pyzmq==27.3.0 openai==3.57.0 sniffio==1.3.1 partial_json_parser==0.2.1.1.post7 dill==0.4.1 \
    sentencepiece==0.2.3 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0
echo "SGLang pieces in $dir"
