"""A real learner step on a batch with NaN advantages (own process: the learner starts
torch.distributed): prints whether the update was skipped, whether the weights stayed as they
were and finite, whether a clean step after it still trains, and whether a checkpoint of
non-finite weights is refused."""

import json
import math
import sys
import tempfile

import torch

from megatron_gspo.loop import build, phases
from megatron_gspo.loop import weight_sync_phase as sync_phase
from megatron_gspo.runtime.run_checkpoint import Checkpointer
from megatron_gspo.config import load_config


def main() -> None:
    cfg = load_config("examples/tiny/config.yaml", [
        "algorithm.mini_batches=2", "train.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=4"])
    hf = build.read_hf_config(cfg.model.path)
    tok = build.tokenizer(cfg)
    prompts, score = build.prompt_stream(cfg, tok), build.reward_scorer(cfg, tok)
    learner = build.learner(cfg, hf)
    build.load_initial_weights(cfg, learner, hf)
    engine = build.rollout_engine(cfg, hf, tok)
    sync_phase.sync_weights(learner, engine, hf, cfg, 0)
    samples, _ = phases.rollout(cfg, engine, prompts, score, tok, 0)
    phases.fill_advantages(cfg, samples)
    good = [s.advantage for s in samples]
    for s in samples[::2]:  # a NaN in every mini-batch
        s.advantage = math.nan
    before = {k: v.clone() for k, v in learner.full_state_dict().items()}
    m_nan = phases.train_on_batch(cfg, learner, samples, None, 0)
    after = learner.full_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    finite = all(torch.isfinite(v).all() for v in after.values())
    for s, a in zip(samples, good, strict=True):
        s.advantage = a
    m_ok = phases.train_on_batch(cfg, learner, samples, None, 0)
    moved = any(not torch.equal(before[k], v) for k, v in learner.full_state_dict().items())
    with torch.no_grad():
        next(learner.chunks[0].parameters()).view(-1)[0] = float("nan")
    refused = False
    with tempfile.TemporaryDirectory() as d:
        try:
            Checkpointer(d).save(1, learner, {"step": 1})
        except Exception as e:  # noqa: BLE001 (old versions raise other types)
            refused = "non-finite" in str(e)
    print("RESULT " + json.dumps({
        "skipped": m_nan.get("update_skipped"), "unchanged": unchanged, "finite": bool(finite),
        "ok_skipped": m_ok.get("update_skipped"), "moved": moved, "refused": refused}))
    learner.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
