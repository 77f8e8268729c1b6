"""The weight sync of a learner built by the run's own builder (`loop.build.learner`) from a tiny
DeepSeek-V3 checkpoint with its MTP layer, into a recording SGLang-like engine through
`loop.weight_sync_phase.sync_weights` (distributed path: `engine.update_weights`), for the
`model.mtp_layers` / rollout choices given as JSON in argv[3]; prints one JSON line.
Run by tests/loop/test_mtp_train.py."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class Recorder:
    """Stands in for `rollout.sglang` on rank 0: records each sync's names and tensors (with
    `delta`, the pairs the `DeltaSender` (base hash) sends, as the SGLang engine does)."""

    def __init__(self):
        self.syncs: list[dict[str, torch.Tensor]] = []
        self.delta = None
        self.sync_stats: dict = {}

    def resume_memory(self):
        pass

    def update_weights(self, buckets, version):
        got = {}
        if self.delta is not None:
            self.delta.begin(version)
        for b in buckets:
            b = list(b)
            if self.delta is not None:
                b = self.delta.encode(b)
                self.delta.commit()
            got.update((n, t.clone()) for n, t in b)
        if self.delta is not None:
            self.delta.finish(True)
        self.syncs.append(got)


def main(model: Path, over: dict) -> None:
    from megatron_gspo.config import load_config
    from megatron_gspo.data.sample import Sample
    from megatron_gspo.loop import build
    from megatron_gspo.loop.weight_sync_phase import sync_weights

    cfg = load_config(None, [f"model.path={model}", "model.dtype=float32",
                             "model.transformer_impl=local", "rollout.dtype=float32",
                             "optimizer.lr=1e-2", *[f"{k}={v}" for k, v in over.items()]])
    hf = build.read_hf_config(cfg.model.path)
    learner = build.learner(cfg, hf)
    build.load_initial_weights(cfg, learner, hf)
    build.load_reference(cfg, learner, hf)  # with algorithm.kl_coef > 0: the policy alone
    ref_mtp = sum(1 for c in learner.reference_chunks or [] for n, _ in c.named_parameters()
                  if n.startswith("mtp."))
    engine = Recorder()
    mtp_params = [p for n, p in learner.chunks[0].named_parameters() if n.startswith("mtp.")]
    in_optimizer = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    sync_weights(learner, engine, hf, cfg, 1)
    rng = random.Random(0)
    samples = [Sample(prompt_ids=[rng.randrange(2, 150) for _ in range(4)],
                      response_ids=[rng.randrange(2, 150) for _ in range(5)],
                      loss_mask=[1] * 5, index=i, advantage=rng.uniform(-1, 1))
               for i in range(4)]
    if learner.reference_chunks is not None:
        lps, ref = learner.forward_logprobs(samples), learner.forward_logprobs(
            samples, reference=True)
        res_ref = max(abs(a - b) for x, y in zip(ref, lps, strict=True)
                      for a, b in zip(x, y, strict=True))  # reference vs initial policy
    else:
        lps, ref, res_ref = learner.forward_logprobs(samples), None, None
    learner.train_step(samples, [[x + 0.01 for x in lp] for lp in lps], ref)
    sync_weights(learner, engine, hf, cfg, 2)
    n = hf["num_hidden_layers"]
    p = f"model.layers.{n}."
    first, second = engine.syncs
    res = {"mtp_params": len(mtp_params), "reference_mtp_params": ref_mtp,
           "reference": learner.reference_chunks is not None, "reference_diff": res_ref,
           "mtp_trainable": sum(int(q.requires_grad) for q in mtp_params),
           "mtp_in_optimizer": sum(int(id(q) in in_optimizer) for q in mtp_params),
           "first": sorted(first), "second": sorted(second)}
    from safetensors.torch import load_file

    sd = load_file(str(model / "model.safetensors"))
    res["first_mtp_equal_input"] = all(torch.equal(t, sd[k]) for k, t in first.items()
                                       if k.startswith(p))
    res["second_mtp_equal_input"] = all(torch.equal(t, sd[k]) for k, t in second.items()
                                        if k.startswith(p))
    res["checkpoint_names"] = sorted(sd)
    print("RESULT " + json.dumps(res))
    learner.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
