"""`rollout.speculative`: speculative rollouts drafted by the model's multi-token-prediction
(MTP) head (DeepSeek-V3 report, arXiv 2412.19437, section 2.2; speculative sampling, Leviathan
et al. arXiv 2211.17192 / Chen et al. arXiv 2302.01318): the engine drafts `num_steps` tokens
with the head and verifies them with the target model in one forward, with exact rejection
sampling (the sampled distribution and the returned log-probs are the target model's).

SGLang servers are launched with `--speculative-algorithm` (NEXTN: the model's MTP head),
`--speculative-num-steps`, `--speculative-eagle-topk`, `--speculative-num-draft-tokens`; the
embedded engine drafts on CPU with the same head. `adaptive` turns drafting on or off per
rollout from the batch size and the measured acceptance (the decision and its inputs are logged).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.config.schema import option


@dataclass
class SpeculativeConfig:
    algorithm: str = option(
        "none", "draft with the model's multi-token-prediction head (mtp; SGLang: NEXTN) or not "
        "(none); needs MTP layers in the learner (model.mtp_layers keep or add)",
        choices=("none", "mtp"))
    num_steps: int = option(2, "draft tokens proposed per verification (SGLang "
                            "--speculative-num-steps: the MTP head chained this many times)",
                            ge=1, le=8)
    topk: int = option(1, "draft branches per step (SGLang --speculative-eagle-topk; the "
                       "embedded engine drafts one chain: 1)", ge=1, le=8)
    num_draft_tokens: int | None = option(
        None, "tokens the target verifies per step (SGLang --speculative-num-draft-tokens); "
        "default num_steps + 1 (a chain with topk 1)", ge=2)
    adaptive: bool | None = option(
        None, "turn drafting on or off per rollout from the batch size and the measured "
        "acceptance (metrics speculative/*); the embedded engine's switch: null = on there, "
        "and off with SGLang servers, which draft every request (true is refused there)")
    max_batch: int = option(64, "adaptive: no drafting while more sequences than this decode "
                            "together (verification then costs more than the drafts save)",
                            ge=1)
    min_acceptance: float = option(0.3, "adaptive: no drafting while the measured acceptance "
                                   "(accepted / proposed draft tokens, running mean) is below "
                                   "this; re-probed every probe_interval rollouts", ge=0, le=1)
    probe_interval: int = option(5, "adaptive: while drafting is off for low acceptance, draft "
                                 "one rollout in this many to measure it again", ge=1)
