"""One RL step of the real loop phases on the tiny demo (own process: the learner starts
torch.distributed): prints the advantage-weighted change of the batch's mean token log-probs."""

import json

from megatron_gspo.loop import build, phases
from megatron_gspo.loop import weight_sync_phase as sync_phase
from megatron_gspo.algo.precision import ToleranceController
from megatron_gspo.config import load_config


def main() -> None:
    cfg = load_config("examples/tiny/config.yaml", [
        "optimizer.lr=5e-5", "algorithm.mini_batches=1", "train.prompts_per_step=16"])
    hf = build.read_hf_config(cfg.model.path)
    tok = build.tokenizer(cfg)
    prompts, score = build.prompt_stream(cfg, tok), build.reward_scorer(cfg, tok)
    learner = build.learner(cfg, hf)
    build.load_initial_weights(cfg, learner, hf)
    engine = build.rollout_engine(cfg, hf, tok)
    sync_phase.sync_weights(learner, engine, hf, cfg, 0)
    samples, _ = phases.rollout(cfg, engine, prompts, score, tok, 0)
    phases.fill_advantages(cfg, samples)
    before = learner.forward_logprobs(samples)
    old, source, _ = phases.old_logprobs(cfg, learner, ToleranceController("rollout", 1.0),
                                         samples, 0)
    phases.train_on_batch(cfg, learner, samples, old, 0)
    after = learner.forward_logprobs(samples)
    delta = [(sum(a) - sum(b)) / len(a) for a, b in zip(after, before, strict=True)]
    adv = [float(s.advantage) for s in samples]
    print("RESULT " + json.dumps({
        "weighted": sum(a * d for a, d in zip(adv, delta, strict=True)),
        "pos": sum(d for a, d in zip(adv, delta, strict=True) if a > 0)
        / max(1, sum(a > 0 for a in adv)),
        "neg": sum(d for a, d in zip(adv, delta, strict=True) if a < 0)
        / max(1, sum(a < 0 for a in adv)),
        "source": source}))
    learner.shutdown()


if __name__ == "__main__":
    main()
