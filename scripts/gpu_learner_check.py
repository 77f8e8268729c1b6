"""GPU check of the Megatron-Core learner: the CPU-proven checks again with CUDA / NCCL and,
where Transformer Engine is installed, the TE layer spec (THD packed attention).

1. reference run on the CPU (gloo, 1 process)            -> ref.pt
2. one GPU, NCCL: local spec (fp32, TF32 off) vs the reference (log-probs, loss, GSPO clip
   statistics, gradients, parameters after one Adam step); TE spec in bf16 when installed
3. with >= 4 GPUs: the 4-rank layout checks (TP/PP/VPP/EP/SP/DP, vocab-parallel log-probs,
   CP reduction) on NCCL

    python scripts/gpu_learner_check.py [--out DIR]

Prints one line per stage and every failed comparison; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.megatron._dist import launch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args()
    import torch

    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_learner_check_"))
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check on GPU")
        return 0
    gpus = torch.cuda.device_count()
    visible = ",".join(str(i) for i in range(gpus))
    failures = []
    stages = [("ref", 1, {}), ("gpu", 1, {"CUDA_VISIBLE_DEVICES": "0"})]
    if gpus >= 4:
        stages.append(("par", 4, {"CUDA_VISIBLE_DEVICES": visible}))
    else:
        print(f"{gpus} GPU(s): the 4-rank NCCL layout checks need 4, skipped")
    for case, n, env in stages:
        try:
            reports = launch(case, n, out, timeout=600, extra_env=env)
        except AssertionError as e:
            print(f"[{case}] FAILED TO RUN\n{e}")
            failures.append(case)
            continue
        fails = [f for r in reports for f in r["failures"]]
        print(f"[{case}] ranks={n} failures={len(fails)} info={json.dumps(reports[0]['info'])}")
        for f in fails:
            print(f"  - {f}")
        failures += fails
    print("OK" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
