"""The learner's multi-token-prediction layers (issue 55, item 2;
`megatron/models/mtp_block.py`), on
tiny DeepSeek-V3 and GLM-4.5 checkpoints with their MTP layer (tests/convert/tiny_mtp.py):

- Megatron-Core's `MultiTokenPredictionBlock`, loaded from the HF tensors, gives the logits of
  a reference written from the DeepSeek-V3 report's MTP module (eq. 21-23: eh_proj over
  [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)], the stored transformer layer, shared_head.norm, the
  shared head) within 1e-5 in fp32 (measured 1.8e-7 for both; transformers has no MTP module to
  compare against: `_keys_to_ignore_on_load_unexpected` drops model.layers.{N}.*);
- with the block present the policy's token log-probs and every gradient are bit-identical to
  the model without it, and no MTP parameter is trainable (the MTP loss is off); the same for
  the real Learner's GSPO forward-backward (`Learner(mtp=True)`, two micro-batches): loss and
  every gradient bit-identical;
- the weight-sync exporter sends every tensor of the checkpoint, MTP layer included, bit for bit;
  with `only_mtp` it sends the MTP layer's own tensors (``model.layers.{N}.*`` but the embedding
  / head copies): what SGLang's NEXTN draft loads (tests/convert/test_sglang_nextn_names.py);
  a model built without its MTP layer (the default) from the same config exports none of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mtp_block_matches_the_paper_reference_and_leaves_the_policy_unchanged(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29583")
    archs = "DeepseekV3ForCausalLM,Glm4MoeForCausalLM"
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_mtp_worker.py")),
                          str(tmp_path), archs], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    print(f"\nMTP learner: {res}")
    assert sorted(res) == sorted(archs.split(","))
    for arch, r in res.items():
        assert r["mtp_params"] > 0 and r["mtp_trainable"] == 0, (arch, r)
        assert r["params_loaded"][1] > r["params_loaded"][0], (arch, r)
        assert r["logprobs_equal"] and r["grads_equal"], (arch, r)
        assert r["learner_mtp_params"][0] == 0 and r["learner_mtp_params"][1] > 0, (arch, r)
        assert r["learner_gspo_equal"] and r["learner_mtp_grads_zero"], (arch, r)
        assert r["mtp_vs_reference"] <= 1e-5, (arch, r)
        assert r["ref_scale"] > 0.1, (arch, r)
        assert r["export_names_equal_checkpoint"] and r["export_bit_exact"], (arch, r)
        assert r["draft_export_is_the_mtp_layer"], (arch, r)
        assert r["no_mtp_export_is_the_main_model"], (arch, r)
