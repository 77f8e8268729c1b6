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

- `add`: a model that ships without MTP layers (Qwen3, Llama dense; DeepSeek-V3 / GLM-4.5
  checkpoints saved without theirs: accepted, not tested) gets one (`run_config` declares it,
  `num_nextn_predict_layers: 1`), initialised as a continuation of the trunk
  (`megatron.models.mtp_block.init_added_mtp`: the last decoder layer and the final norm
  copied, eh_proj = [0 | I]); an error on a
  checkpoint that has MTP layers, and from a Megatron `model.load_checkpoint`.

`algorithm.mtp_loss_weight` > 0 trains them (kept or added) online on the rollout tokens
(`megatron.mtp_loss`): cross-entropy of layer k's prediction of token i + k + 1 where that token
is a response token, the head's inputs detached so its gradient reaches only the MTP parameters
and the policy's update is the one without it; logged as `mtp/loss`, `mtp/accuracy` (argmax
agreement of the head with the sampled next tokens) and `mtp/tokens`; `algorithm.mtp_lr` sets
the head's own peak learning rate (its parameters see only this loss, so under Adam the weight
works as an on / off switch more than a scale). A weight > 0 without MTP
layers is an error. At weight 0 they are frozen (no gradient, no optimizer state). Either way
they are saved and loaded with the run checkpoints, and `convert mcore-to-hf` exports them (an
added layer under DeepSeek-V3's HF names, with `num_nextn_predict_layers` in config.json, which
`hf-to-mcore` and `model.path` read back). Weight syncs carry their own tensors (not the
embedding / head copies: the draft uses the target's) to every engine that drafts
(`has_draft`): SGLang servers launched with `rollout.speculative` or `--speculative-algorithm`,
or attached by URL, whose scheduler hands them to the draft and the target model (the
target's loader skips layer ids >= num_hidden_layers; 0.5.12's distributed path reaches the
draft only through the project's link loader, `rollout/sglang/speculative.py`), and the
embedded engine with `rollout.speculative.algorithm: mtp` (its `rollout.mtp_draft` head). Delta
syncs send them when they changed: once while frozen, after every step while trained.
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


def run_config(cfg: Config, hf_config: dict) -> dict:
    """The config.json the run's learner, syncs and checkpoints use: `hf_config` declaring one
    MTP layer (`CONFIG_KEY`) under `model.mtp_layers: add`, as it is otherwise. Its exports then
    carry the added layer under the DeepSeek-V3 names (`convert.mtp`)."""
    from megatron_gspo.convert.mtp import CONFIG_KEY

    if cfg.model.mtp_layers != "add":
        return hf_config
    return dict(hf_config, **{CONFIG_KEY: ADDED_LAYERS})


ADDED_LAYERS = 1  # MTP layers `add` builds (SGLang's NEXTN / EAGLE drafts use one)


def mtp_layers(cfg: Config, hf_config: dict) -> bool:
    """Whether the learner builds MTP layers (`model.mtp_layers`; trained when
    `algorithm.mtp_loss_weight` > 0).

    Args:
        cfg: the run config.
        hf_config: model.path's config.json (or `run_config`'s).
    Returns:
        True to build them (the checkpoint's, or `add`'s new one).
    Raises:
        ConfigError: a choice this checkpoint, family or layout cannot honour (one line).
    """
    choice = cfg.model.mtp_layers
    src = cfg.model.load_checkpoint or cfg.model.path
    if cfg.algorithm.mtp_lr and not cfg.algorithm.mtp_loss_weight:
        raise ConfigError(f"algorithm.mtp_lr: {cfg.algorithm.mtp_lr}, but algorithm."
                          "mtp_loss_weight is 0 (the MTP head is frozen); set the weight or "
                          "drop mtp_lr")
    if choice == "add":
        _check_add(cfg, hf_config, src)
    n, why = _present(cfg, hf_config)
    if choice == "keep" and why:
        raise ConfigError(f"model.mtp_layers: 'keep', but {why}; drop the setting")
    if choice in ("keep", "drop") and n == 0:
        raise ConfigError(f"model.mtp_layers: {choice!r}, but {src} has no multi-token-"
                          "prediction layer; drop the setting")
    if choice == "drop" or (n == 0 and choice != "add"):
        if cfg.algorithm.mtp_loss_weight > 0:
            raise ConfigError(f"algorithm.mtp_loss_weight: {cfg.algorithm.mtp_loss_weight}, but "
                              f"the learner builds no MTP layer ({src} has none or "
                              f"model.mtp_layers is {choice!r}); set model.mtp_layers: add, or "
                              "algorithm.mtp_loss_weight: 0")
        return False
    declared = int(hf_config.get("num_nextn_predict_layers") or 0)
    if choice != "add" and n != declared:
        raise ConfigError(f"model.mtp_layers: {src} has {n} MTP layers where its config.json "
                          f"declares {declared}; set num_nextn_predict_layers: {n}, or "
                          "model.mtp_layers: drop")
    p = cfg.parallel
    bad = [f"parallel.{k} {v}" for k, v in (("tensor", p.tensor), ("pipeline", p.pipeline),
                                             ("expert", p.expert), ("context", p.context))
           if v > 1]
    what = "an added MTP layer" if choice == "add" else f"{n} MTP layer(s), kept by {choice!r}"
    if bad:
        raise ConfigError(f"model.mtp_layers: {src} has {what}, but a learner with them under "
                          f"{bad[0]} is not supported yet (one process or data parallelism "
                          "only); set model.mtp_layers: drop")
    if cfg.model.lora.rank:
        raise ConfigError("model.mtp_layers: MTP layers with model.lora are not supported "
                          "yet (adapters would be attached to the MTP layers); set "
                          "model.mtp_layers: drop")
    r = cfg.rollout
    if sync_mode(cfg) == SYNC_MTP_LAYERS and r.weight_precision != "bf16":
        raise ConfigError(f"model.mtp_layers: kept MTP layers with rollout.weight_precision "
                          f"{r.weight_precision!r} servers are not supported yet; set "
                          "model.mtp_layers: drop or rollout.weight_precision: bf16")
    return True


def _check_add(cfg: Config, hf_config: dict, src: str) -> None:
    """`add`'s own refusals (one line each)."""
    from megatron_gspo.convert.mtp import MTP_ARCHITECTURES

    arch = (hf_config.get("architectures") or ["?"])[0]
    if arch not in MTP_ARCHITECTURES:
        raise ConfigError(f"model.mtp_layers: 'add', but {arch}'s MTP layers are not built here "
                          f"({', '.join(MTP_ARCHITECTURES)} only); drop the setting")
    if cfg.model.load_checkpoint:
        from megatron_gspo.megatron.io.dist_checkpoint import checkpoint_has_mtp

        has = checkpoint_has_mtp(cfg.model.load_checkpoint)
        raise ConfigError(f"model.mtp_layers: 'add', but {src} " + (
            "already has multi-token-prediction layers; use model.mtp_layers: keep (or auto)"
            if has else "is a Megatron checkpoint (add starts from a Hugging Face model.path); "
            "convert it with mcore-to-hf first"))
    if _present(cfg, hf_config)[0]:
        raise ConfigError(f"model.mtp_layers: 'add', but {src} already has multi-token-"
                          "prediction layers; use model.mtp_layers: keep (or auto)")


def has_draft(cfg: Config) -> bool:
    """The rollout engine may hold a draft model: any engine drafting with the MTP head
    (`rollout.speculative.algorithm` mtp: the embedded engine's `rollout.mtp_draft`, SGLang's
    NEXTN), SGLang launched with ``--speculative-algorithm`` (in rollout.extra_server_args), or
    attached by URL (their launch is not ours to read)."""
    r = cfg.rollout
    if r.speculative.algorithm == "mtp":
        return True
    if r.engine != "sglang":
        return False
    spec = any(a.split("=", 1)[0] == "--speculative-algorithm" for a in r.extra_server_args)
    return spec or bool(r.server_urls) or bool(r.router_url)


def sync_mode(cfg: Config) -> str:
    """What the weight sync sends of kept or added MTP layers: their own tensors (not the
    embedding / head copies) to an engine that may hold a draft (`has_draft`: SGLang servers,
    or the embedded engine drafting with them), nothing otherwise."""
    return SYNC_MTP_LAYERS if has_draft(cfg) else SYNC_NO_MTP


def mark_sync(learner, cfg: Config) -> None:
    """Record on each of the learner's model chunks what the weight sync exports of its MTP
    layers (`megatron.io.weight_export.export_hf_weights` reads ``mtp_export``)."""
    mode = sync_mode(cfg)
    for m in getattr(learner, "chunks", ()):
        while hasattr(m, "module"):
            m = m.module
        m.mtp_export = mode
