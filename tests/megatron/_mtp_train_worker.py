"""The MTP head's draft-training loss in the real Learner (`megatron/mtp_loss.py`); prints one
JSON line. Run by tests/megatron/test_mtp_draft_loss.py.

Usage: _mtp_train_worker.py WORK ARCH MODE [STEPS]
  ARCH: an HF architecture; "tiny" = the demo model examples/tiny/base (Qwen3, MTP added);
        Qwen3 / Llama from tests/convert/tiny_models, tied (MTP added); DeepSeek-V3 / GLM-4.5 from
        tests/convert/tiny_mtp (their MTP layer kept).
  MODE (suffix "-recompute": full activation recompute): "isolation": one GSPO
        forward-backward + optimizer step at mtp weight 0 and 1 from the
        same weights: every non-MTP gradient and updated policy weight, loss and grad_norm;
        "learn": STEPS optimizer steps on one fixed batch, the head's accuracy per step;
        "readback" (ARCH: an HF directory with an MTP layer): the loop's learner built on it as
        model.path, its export against the files.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def make_model(work: Path, arch: str) -> tuple[Path, bool]:
    """(HF directory, whether its MTP layer is added) for `arch`."""
    if arch == "tiny":
        return ROOT / "examples" / "tiny" / "base", True
    out = work / arch
    from megatron_gspo.convert.mtp import ADDED_MTP_ARCHITECTURES

    if arch in ADDED_MTP_ARCHITECTURES:  # tied embeddings: the other output-weight path
        from tests.convert.tiny_models import make_tiny_model

        make_tiny_model(arch, out, tie_word_embeddings=True)
        return out, True
    from tests.convert.tiny_mtp import make_mtp_checkpoint

    make_mtp_checkpoint(arch, out)
    return out, False


def build(hf_dir: Path, added: bool, weight: float, lr: float = 1e-3,
          mtp_lr: float | None = None):
    recompute = RECOMPUTE
    """A Learner with MTP layers at loss weight `weight`, loaded from `hf_dir` (an added layer
    initialised by `init_added_mtp`)."""
    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.models.mtp_block import init_added_mtp
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.step import LossSettings

    reader = HFCheckpointReader(hf_dir)
    cfg = cio.normalize_hf_config(reader.config)
    if added:
        cfg["num_nextn_predict_layers"] = 1
    L = Learner(cfg, optim=OptimSettings(lr=lr, clip_grad=1.0, mtp_lr=mtp_lr), seed=11, mtp=True,
                recompute=recompute,
                loss=LossSettings(kind="gspo", mtp_weight=weight),
                batching=BatchSettings(num_microbatches=2))
    adapter = get_adapter(cfg)
    cio.load_hf_weights(L.chunks, reader, adapter, adapter.dims(cfg), skip_mtp=added)
    reader.close()
    if added:
        for m in L.chunks:
            init_added_mtp(m)
    L._refresh_main_params()
    return L, cfg


def samples(vocab: int, n: int = 8, seed: int = 0):
    """Fixed samples whose responses follow a learnable rule (token t+1 = t + 1 mod a band)."""
    from megatron_gspo.data.sample import Sample

    rng = random.Random(seed)
    hi = min(vocab, 120)
    out = []
    for i in range(n):
        start = rng.randrange(4, hi)
        resp = [4 + (start - 4 + j) % (hi - 4) for j in range(6 + i % 4)]
        out.append(Sample(prompt_ids=[rng.randrange(4, hi) for _ in range(3 + i % 3)],
                          response_ids=resp, loss_mask=[1] * len(resp), index=i,
                          advantage=rng.uniform(-1, 1)))
    return out


def isolation(hf_dir: Path, added: bool) -> dict:
    runs = {}
    for weight in (0.0, 1.0):  # at weight 1 the head has its own LR (10x the policy's)
        L, cfg = build(hf_dir, added, weight, mtp_lr=1e-2 if weight else None)
        batch = samples(cfg["vocab_size"])
        old = [[x + 0.01 for x in lp] for lp in L.forward_logprobs(batch)]
        m = L.forward_backward(batch, old)
        grads = L.full_grads()
        trainable = sorted(n for c in L.chunks for n, p in c.named_parameters()
                           if p.requires_grad and n.startswith("mtp."))
        in_opt = sum(p.numel() for g in L.optimizer.param_groups for p in g["params"])
        before = {k: v.clone() for k, v in L.full_state_dict().items()}
        step = L.optimizer_step()
        after = L.full_state_dict()
        runs[weight] = dict(m=m, grads=grads, trainable=trainable, in_opt=in_opt, step=step,
                            before=before, after=after)
        L.shutdown()
    r0, r1 = runs[0.0], runs[1.0]
    main = [k for k in r0["grads"] if not k.startswith("mtp.")]
    mtp = [k for k in r1["grads"] if k.startswith("mtp.")]
    diff = max(float((r0["grads"][k] - r1["grads"][k]).abs().max()) for k in main)
    moved = max(float((r0["after"][k] - r1["after"][k]).abs().max()) for k in main)
    return {
        "main_grads": len(main), "main_grad_max_diff": diff,
        "main_grads_bitwise": all(torch.equal(r0["grads"][k], r1["grads"][k]) for k in main),
        "mtp_grads": len(mtp),
        "mtp_grads_nonzero": sum(int(bool(r1["grads"][k].any())) for k in mtp),
        "mtp_grads_zero_at_weight_0": all(not r0["grads"][k].any() for k in mtp
                                          if k in r0["grads"]),
        "trainable_mtp": [len(r0["trainable"]), len(r1["trainable"])],
        "optimizer_numel": [r0["in_opt"], r1["in_opt"]],
        "loss": [r0["m"]["loss"], r1["m"]["loss"]],
        "grad_norm": [r0["step"]["grad_norm"], r1["step"]["grad_norm"]],
        "policy_after_step_max_diff": moved,
        "policy_moved": max(float((r0["after"][k] - r0["before"][k]).abs().max()) for k in main),
        "mtp_moved": [max(float((r["after"][k] - r["before"][k]).abs().max())
                          for k in r["after"] if k.startswith("mtp.")) for r in (r0, r1)],
        "mtp_metrics": {k: v for k, v in r1["m"].items() if k.startswith("mtp/")},
        "mtp_metrics_at_weight_0": sorted(k for k in r0["m"] if k.startswith("mtp")),
    }


def learn(hf_dir: Path, added: bool, steps: int) -> dict:
    L, cfg = build(hf_dir, added, 1.0, lr=1e-4, mtp_lr=3e-3)  # the demo's policy LR
    batch = samples(cfg["vocab_size"], n=12)
    acc, loss = [], []
    for _ in range(steps):
        old = [[x + 0.01 for x in lp] for lp in L.forward_logprobs(batch)]
        m = L.train_step(batch, old)
        acc.append(m["mtp/accuracy"])
        loss.append(m["mtp/loss"])
    L.shutdown()
    return {"accuracy": acc, "loss": loss}


def readback(hf_dir: Path) -> dict:
    """The loop's learner on `model.path` = `hf_dir` (an export with an added MTP layer), its
    initial weights loaded as a run loads them: `model.mtp_layers` auto keeps the layer, and
    every tensor the learner exports equals the file's."""
    from megatron_gspo.config import load_config
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.loop import build
    from megatron_gspo.megatron.io.weight_export import export_hf_weights

    cfg = load_config(None, [f"model.path={hf_dir}", "algorithm.mtp_loss_weight=1",
                             "model.dtype=float32"])
    hf = build.read_hf_config(str(hf_dir))
    L = build.learner(cfg, hf)
    build.load_initial_weights(cfg, L, hf)
    for m in L.chunks:  # everything, as a conversion exports it (not the sync's choice)
        del m.mtp_export
    sent = {k: t for b in export_hf_weights(L.chunks, hf, bucket_bytes=1 << 24) for k, t in b}
    reader = HFCheckpointReader(hf_dir)
    names = sorted(reader.keys())
    res = {"mtp_params": sum(1 for c in L.chunks for n, p in c.named_parameters()
                             if n.startswith("mtp.") and p.requires_grad),
           "names_equal": sorted(sent) == names, "tensors": len(names),
           "differ": [k for k in names if k in sent and not torch.equal(sent[k], reader.get(k))],
           "bit_exact": all(torch.equal(sent[k], reader.get(k)) for k in names if k in sent)}
    reader.close()
    L.shutdown()
    return res


RECOMPUTE = False


def main() -> None:
    global RECOMPUTE
    work, arch, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if mode == "readback":  # ARCH: an HF directory
        print("RESULT " + json.dumps(readback(Path(arch))))
        return
    RECOMPUTE = mode.endswith("-recompute")  # full activation recompute
    mode = mode.removesuffix("-recompute")
    hf_dir, added = make_model(work, arch)
    res = isolation(hf_dir, added) if mode == "isolation" else learn(
        hf_dir, added, int(sys.argv[4]))
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
