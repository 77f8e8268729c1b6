"""Convert checkpoints between Hugging Face safetensors and Megatron-Core distributed format.

  hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N --dtype fp32|bf16|fp16] [--force]
  mcore-to-hf --ckpt DIR [--hf-config DIR] --out DIR [--dtype ...] [--max-shard-size GB]
              [--tp N --pp N --ep N] [--force]
  lora-to-peft --ckpt DIR [--base DIR] [--out DIR] [--merged DIR] [--dtype ...] [--force]

Thin wrapper over `megatron_gspo.cli.convert` (also `megatron-gspo convert ...`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_gspo.cli.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog=None))  # usage lines name this script
