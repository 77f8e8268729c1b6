"""`rollout.speculative` in a run: the refusals that need more than the config (the learner's
MTP layers) and the embedded engine's drafting arguments (`rollout.embedded_speculative`,
`rollout.speculative_control`). Settings the config alone rules out (speculative fields while
the algorithm is none) are refused by `config.unused`; SGLang's launch flags and their checks
live in `rollout.sglang.speculative`.
"""

from __future__ import annotations

from megatron_gspo.config import Config, ConfigError


def check(cfg: Config, mtp_built: bool, moe: bool) -> None:
    """Refuse drafting the run cannot do (one line).

    Args:
        cfg: the run config.
        mtp_built: whether the learner builds MTP layers (`mtp_setting.mtp_layers`).
        moe: the model is an MoE model (its engine routing would be captured).
    Raises:
        ConfigError: algorithm mtp without MTP layers in the learner; the embedded engine with
            branching drafts (topk > 1) or a draft-token count other than a chain's; with
            engine routing capture (r3 replay of the engine's routing).
    """
    s, r = cfg.rollout.speculative, cfg.rollout
    if s.algorithm != "mtp":
        return
    if not mtp_built:
        raise ConfigError(
            f"rollout.speculative.algorithm: 'mtp' drafts with the model's MTP head, but the "
            f"learner builds none (model.mtp_layers {cfg.model.mtp_layers!r}, "
            f"{cfg.model.load_checkpoint or cfg.model.path} without MTP layers); set "
            "model.mtp_layers: add (and algorithm.mtp_loss_weight > 0 to train it) or keep")
    if r.engine != "embedded":
        return
    if s.topk > 1:
        raise ConfigError(f"rollout.speculative.topk: {s.topk}, but the embedded engine drafts "
                          "one chain (topk 1)")
    if s.num_draft_tokens is not None and s.num_draft_tokens != s.num_steps + 1:
        raise ConfigError(f"rollout.speculative.num_draft_tokens: {s.num_draft_tokens}, but the "
                          f"embedded engine verifies a chain of num_steps + 1 = "
                          f"{s.num_steps + 1}; drop it")
    if moe and cfg.moe.engine_routing:
        raise ConfigError("rollout.speculative.algorithm: 'mtp' with moe.engine_routing is not "
                          "supported on the embedded engine (a verification's rejected slots "
                          "have no routing to replay); set one of them off")


def embedded_kwargs(cfg: Config) -> dict:
    """`EmbeddedEngine` arguments for drafting: {} unless `rollout.speculative.algorithm` mtp."""
    s = cfg.rollout.speculative
    if s.algorithm != "mtp":
        return {}
    from megatron_gspo.rollout.speculative_control import DraftControl

    return {"draft_steps": s.num_steps,
            "draft_control": DraftControl(adaptive=s.adaptive is not False, max_batch=s.max_batch,
                                          min_acceptance=s.min_acceptance,
                                          probe_interval=s.probe_interval)}
