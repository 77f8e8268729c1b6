"""The algorithm in pure torch: GSPO / GSPO-token / GRPO losses (arXiv 2507.18071), SAPO, CISPO
and GMPO, group and turn-level advantages, chunked token log-probs, KL-to-reference and entropy
terms, and the engine/learner precision audit with its corrections (TIS, masking, MIS, IcePop,
off-policy sequence masking), and speculative sampling's exact verification of draft chains.
No Megatron, no config: tensors and scalars in, tensors out.

    from megatron_gspo.algo import gspo_loss, group_advantages, token_logprobs, kl_loss
"""

from megatron_gspo.algo.advantages import group_advantages, zero_variance_groups
from megatron_gspo.algo.cispo import cispo_loss
from megatron_gspo.algo.corrections import (icepop_token_mask, mis_weights,
                                            offpolicy_sequence_mask)
from megatron_gspo.algo.gmpo import gmpo_loss
from megatron_gspo.algo.kl import (ESTIMATORS, entropy_loss, kl_loss, kl_reward, sequence_kl,
                                   token_kl)
from megatron_gspo.algo.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs
from megatron_gspo.algo.losses import (AGGREGATIONS, LOGRATIO_BOUND, finalize_stats, gspo_loss,
                                       gspo_token_loss, grpo_loss, sequence_log_ratio)
from megatron_gspo.algo.precision import (ToleranceController, apply_correction, audit_sums,
                                          correction_metrics,
                                          check_engine_logprobs, finalize_audit, length_bins,
                                          mismatch_band, sequence_mismatch)
from megatron_gspo.algo.sapo import sapo_gate, sapo_loss
from megatron_gspo.algo.speculative_sampling import emitted_logprobs, verify_chain
from megatron_gspo.algo.turn_advantages import (assign_multiturn_advantages,
                                                discounted_returns, episode_level_advantages,
                                                turn_level_advantages)

__all__ = [
    # losses
    "gspo_loss", "gspo_token_loss", "grpo_loss", "sequence_log_ratio", "finalize_stats",
    "LOGRATIO_BOUND", "AGGREGATIONS", "sapo_loss", "sapo_gate", "cispo_loss", "gmpo_loss",
    # advantages
    "group_advantages", "zero_variance_groups", "discounted_returns", "turn_level_advantages",
    "episode_level_advantages", "assign_multiturn_advantages",
    # log-probs
    "token_logprobs", "DEFAULT_CHUNK_SIZE",
    # KL to a reference, entropy bonus
    "token_kl", "sequence_kl", "kl_loss", "kl_reward", "entropy_loss", "ESTIMATORS",
    # precision audit of engine log-probs
    "sequence_mismatch", "audit_sums", "finalize_audit", "mismatch_band", "apply_correction",
    "check_engine_logprobs", "ToleranceController", "icepop_token_mask", "mis_weights",
    "offpolicy_sequence_mask", "correction_metrics", "length_bins",
    # speculative sampling (exact verification of draft chains)
    "verify_chain", "emitted_logprobs",
]
