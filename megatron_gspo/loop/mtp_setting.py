"""`model.mtp_layers`: what a training run does with the multi-token-prediction (MTP) layers of
its checkpoint (DeepSeek-V3 report, arXiv 2412.19437, section 2.2; `convert.mtp`,
`megatron.models.mtp_block`).

- `auto` (default): keep them when the checkpoint has them. A user who fine-tunes DeepSeek-V3 or
  GLM-4.5 expects the checkpoints and the `mcore-to-hf` export of the run to hold what the base
  shipped (SGLang's speculative NEXTN decoding loads that layer); dropping it silently was the
  old behaviour. Where keeping is not supported yet the run stops with one line naming
  `drop`, never drops them on its own.
- `keep`: the same, and an error when the checkpoint has none or its family's MTP layers are
  not built here (Qwen3-Next / Qwen3.5, DeepSeek-V3.2, GLM-5).
- `drop`: build none (the policy is the same either way: the MTP layers are not in its
  forward); an error when there is nothing to drop.

Kept layers are frozen (no gradient, no optimizer state; no draft-training loss exists yet),
saved and loaded with the run checkpoints. Weight syncs carry their own tensors (not the
embedding / head copies: SGLang's draft uses the target's) to SGLang servers launched with
`--speculative-algorithm` or attached by URL, whose scheduler hands the same tensors to the
draft and the target model (the target's loader skips layer ids >= num_hidden_layers); the
embedded engine has no draft and gets none. Delta syncs send them once (they never change).
"""

from __future__ import annotations

from megatron_gspo.config import Config, ConfigError

# the sync's MTP part: `megatron.io.weight_export` reads it from each model chunk
SYNC_MTP_LAYERS, SYNC_NO_MTP = "layers", "none"


def _present(cfg: Config, hf_config: dict) -> tuple[int, str]:
    """(MTP layers the initial weights hold, why none can be built: "" when they can)."""
    from megatron_gspo.convert.mtp import CONFIG_KEY, MTP_ARCHITECTURES, declared_mtp_layers

    arch = (hf_config.get("architectures") or ["?"])[0]
    if cfg.model.load_checkpoint:
        from megatron_gspo.megatron.io.dist_checkpoint import checkpoint_has_mtp

        n = declared_mtp_layers(hf_config) if checkpoint_has_mtp(cfg.model.load_checkpoint) \
            else 0
    elif arch in MTP_ARCHITECTURES:
        from megatron_gspo.convert.hf_io import HFCheckpointReader

        reader = HFCheckpointReader(cfg.model.path)  # counts the layers really present
        try:
            n = int(reader.config.get(CONFIG_KEY) or 0)
        finally:
            reader.close()
    else:
        n = 0
    why = "" if arch in MTP_ARCHITECTURES else (
        f"{arch}'s MTP layers are not built here (DeepSeek-V3 and GLM-4.5 only)")
    return n, why


def mtp_layers(cfg: Config, hf_config: dict) -> bool:
    """Whether the learner builds the checkpoint's MTP layers (`model.mtp_layers`).

    Args:
        cfg: the run config.
        hf_config: model.path's config.json.
    Returns:
        True to build them (frozen).
    Raises:
        ConfigError: a choice this checkpoint, family or layout cannot honour (one line).
    """
    choice = cfg.model.mtp_layers
    src = cfg.model.load_checkpoint or cfg.model.path
    n, why = _present(cfg, hf_config)
    if choice == "keep" and why:
        raise ConfigError(f"model.mtp_layers: 'keep', but {why}; drop the setting")
    if choice != "auto" and n == 0:
        raise ConfigError(f"model.mtp_layers: {choice!r}, but {src} has no multi-token-"
                          "prediction layer; drop the setting")
    if choice == "drop" or n == 0:
        return False
    declared = int(hf_config.get("num_nextn_predict_layers") or 0)
    if n != declared:
        raise ConfigError(f"model.mtp_layers: {src} has {n} MTP layers where its config.json "
                          f"declares {declared}; set num_nextn_predict_layers: {n}, or "
                          "model.mtp_layers: drop")
    p = cfg.parallel
    bad = [f"parallel.{k} {v}" for k, v in (("tensor", p.tensor), ("pipeline", p.pipeline),
                                             ("expert", p.expert), ("context", p.context))
           if v > 1]
    if bad:
        raise ConfigError(f"model.mtp_layers: {src} has {n} MTP layer(s), kept by "
                          f"{choice!r}, but a learner with them under {bad[0]} is not "
                          "supported yet (one process or data parallelism only); set "
                          "model.mtp_layers: drop")
    if cfg.model.lora.rank:
        raise ConfigError("model.mtp_layers: kept MTP layers with model.lora are not supported "
                          "yet (adapters would be attached to the frozen MTP layers); set "
                          "model.mtp_layers: drop")
    r = cfg.rollout
    if sync_mode(cfg) == SYNC_MTP_LAYERS and r.weight_precision != "bf16":
        raise ConfigError(f"model.mtp_layers: kept MTP layers with rollout.weight_precision "
                          f"{r.weight_precision!r} servers are not supported yet; set "
                          "model.mtp_layers: drop or rollout.weight_precision: bf16")
    return True


def has_draft(cfg: Config) -> bool:
    """The rollout servers may hold a draft model: SGLang launched with
    ``--speculative-algorithm`` (in rollout.extra_server_args), or attached by URL (their
    launch is not ours to read)."""
    r = cfg.rollout
    if r.engine != "sglang":
        return False
    spec = any(a.split("=", 1)[0] == "--speculative-algorithm" for a in r.extra_server_args)
    return spec or bool(r.server_urls) or bool(r.router_url)


def sync_mode(cfg: Config) -> str:
    """What the weight sync sends of kept MTP layers: their own tensors to servers that may
    hold a draft (`has_draft`), nothing otherwise."""
    return SYNC_MTP_LAYERS if has_draft(cfg) else SYNC_NO_MTP


def mark_sync(learner, cfg: Config) -> None:
    """Record on each of the learner's model chunks what the weight sync exports of its MTP
    layers (`megatron.io.weight_export.export_hf_weights` reads ``mtp_export``)."""
    mode = sync_mode(cfg)
    for m in getattr(learner, "chunks", ()):
        while hasattr(m, "module"):
            m = m.module
        m.mtp_export = mode
