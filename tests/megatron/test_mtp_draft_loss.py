"""The MTP head's draft-training loss (issue 58 item 1; `megatron/mtp_loss.py`) in the real
Learner (tests/megatron/_mtp_train_worker.py):

- gradient isolation: one GSPO forward-backward + optimizer step from the same weights at
  `mtp_weight` 0 and 1: every non-MTP gradient bit-identical, the loss and grad_norm (clipping
  active: the tiny demo's grad_norm is ~16 under clip 1.0) identical, the policy weights after the
  step bit-identical; the MTP parameters frozen and outside the optimizer at weight 0, trainable,
  with non-zero gradients and moved by the step at weight 1; `mtp/*` metrics only at weight 1;
- on the tiny demo (Qwen3, MTP layer added by `init_added_mtp`; also under full activation
  recompute), on Llama (added, tied embeddings) and on DeepSeek-V3 (its checkpoint's MTP layer
  kept, trained when the weight is > 0);
- the head's own learning rate (`algorithm.mtp_lr`, a Megatron-Core parameter-group override):
  10x the policy's moves the head 10x as far in the first Adam step, the policy as without it;
- the head learns: its accuracy on a fixed batch rises over a few optimizer steps (policy LR
  1e-4 as in the demo, head LR 3e-3);
- `mtp_loss.mtp_loss` covers exactly the positions whose k-step-ahead target is a response token
  of the same packed sequence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _worker(tmp_path: Path, arch: str, mode: str, *extra: str, port: int = 29721) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_mtp_train_worker.py")),
                          str(tmp_path), arch, mode, *extra], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])


def _check_isolation(r: dict) -> None:
    print(f"\nMTP isolation: {r}")
    assert r["main_grads"] > 10 and r["main_grads_bitwise"] and r["main_grad_max_diff"] == 0.0
    assert r["loss"][0] == r["loss"][1] and r["grad_norm"][0] == r["grad_norm"][1]
    assert r["policy_moved"] > 0 and r["policy_after_step_max_diff"] == 0.0
    assert r["trainable_mtp"][0] == 0 and r["trainable_mtp"][1] == r["mtp_grads"] > 5
    assert r["optimizer_numel"][1] > r["optimizer_numel"][0]  # the head joins the optimizer
    assert r["mtp_grads_zero_at_weight_0"]
    # every MTP gradient but enorm's (behind eh_proj's zero embedding half when added) is live
    assert r["mtp_grads_nonzero"] >= r["mtp_grads"] - 1
    # Adam's first step moves a parameter by ~its LR: the head's own (1e-2), the policy's 1e-3
    assert r["mtp_moved"][0] == 0.0 and r["mtp_moved"][1] > 5 * r["policy_moved"]
    m = r["mtp_metrics"]
    assert sorted(m) == ["mtp/accuracy", "mtp/loss", "mtp/tokens"] and m["mtp/tokens"] > 10
    assert 0 < m["mtp/loss"] < 20 and 0 <= m["mtp/accuracy"] <= 1
    assert r["mtp_metrics_at_weight_0"] == []


def test_mtp_loss_leaves_the_policy_gradient_and_step_unchanged_tiny_demo(tmp_path):
    _check_isolation(_worker(tmp_path, "tiny", "isolation"))


@pytest.mark.slow
@pytest.mark.parametrize("arch,mode", [("LlamaForCausalLM", "isolation"),
                                       ("DeepseekV3ForCausalLM", "isolation"),
                                       ("tiny", "isolation-recompute")])
def test_mtp_loss_isolation_other_families(tmp_path, arch, mode):
    _check_isolation(_worker(tmp_path, arch, mode, port=29722))


@pytest.mark.slow
def test_the_added_head_learns_on_a_fixed_batch(tmp_path):
    r = _worker(tmp_path, "tiny", "learn", "8", port=29723)
    acc, loss = r["accuracy"], r["loss"]
    print(f"\nMTP head on a fixed batch, 8 steps: accuracy {[round(a, 3) for a in acc]}, "
          f"loss {[round(x, 3) for x in loss]}")
    assert acc[-1] > acc[0] + 0.1 and max(acc[-3:]) > 0.15
    assert loss[-1] < loss[0] - 0.5


def test_mtp_loss_positions_and_normalisation():
    from megatron_gspo.megatron.mtp_loss import finalize, mtp_loss

    V, S = 5, 9
    # two packed sequences [0, 5) and [5, 9); loss_mask[i] = 1: targets[i] is a response token
    targets = torch.tensor([1, 2, 3, 4, 0, 2, 3, 1, 0])
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 0])
    cu = torch.tensor([0, 5, 9])
    logits = torch.zeros(1, S, V + 2, requires_grad=True)  # two padding columns
    with torch.no_grad():
        logits[0, :, V:] = 50.0  # padding columns must not count
        logits[0, 1, 3] = 10.0  # position 1 predicts targets[2] = 3 (k = 1): right
        logits[0, 5, 1] = 10.0  # position 5 predicts targets[6] = 3: wrong
    part, sums = mtp_loss([logits], targets, mask, cu, weight=2.0, num_tokens=4.0, vocab_size=V)
    # k = 1 covers i with mask[i + 1] = 1 in the same sequence: i = 1, 2, 5, 6
    assert float(sums["mtp_count"]) == 4.0 and float(sums["mtp_correct"]) == 1.0
    ce = torch.nn.functional.cross_entropy(logits[0, [1, 2, 5, 6], :V], targets[[2, 3, 6, 7]],
                                           reduction="sum")
    assert torch.allclose(part, ce * 2.0 / 4.0)
    part.backward()
    covered = logits.grad[0].abs().sum(-1) > 0
    assert covered.tolist() == [i in (1, 2, 5, 6) for i in range(S)]
    assert not logits.grad[0, :, V:].any()
    out = finalize({k: float(v) for k, v in sums.items()})
    assert out["mtp/accuracy"] == 0.25 and abs(out["mtp/loss"] - float(ce) / 4) < 1e-6
    # a second layer (k = 2) covers i with mask[i + 2] = 1 in the same sequence
    _, sums2 = mtp_loss([logits.detach()] * 2, targets, mask, cu, weight=1.0, num_tokens=4.0,
                        vocab_size=V)
    assert float(sums2["mtp_count"]) == 4.0 + 3.0  # k = 2: i = 0, 1, 5 (4 -> 6 crosses)
