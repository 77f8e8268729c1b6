"""The multi-token-prediction (MTP) layers of DeepSeek-V3 / GLM-4.5 in the learner: Megatron-Core's
own `MultiTokenPredictionBlock` (transformer/multi_token_prediction.py), one
`MultiTokenPredictionLayer` per ``num_nextn_predict_layers`` (DeepSeek-V3 report, arXiv
2412.19437, section 2.2: h' = eh_proj([RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]) -> one
transformer layer -> final norm -> the main model's output head).

The block is built from `get_mtp_layer_spec` with ``mtp_num_layers`` set on a copy of the model's
config, and held by the GPTModel as ``model.mtp``: its parameters are named
``mtp.layers.{k}.*`` as Megatron-Core names them (`convert.mtp` maps them from and to HF), so
checkpoints, conversion and the weight-sync export carry them.

It is deliberately NOT passed to GPTModel as ``mtp_block_spec``: GPTModel then runs the block in
every forward and folds an MTP language-model loss into the gradient (`MTPLossAutoScaler`; in
0.16.1 it also needs ``labels``, which the learner's log-prob forward does not pass). The RL loss
must stay the policy's alone: the policy forward here is the plain GPTModel forward, and the MTP
parameters are frozen (``requires_grad=False``: no optimizer state, no weight decay) unless
the draft-training loss is on (`megatron.mtp_loss`: the head trained on detached inputs, in its
own forward after the policy's). `mtp_logits` runs the head on its own (drafting, tests);
`init_added_mtp` initialises layers added to a model that shipped without.

The block is built on the last pipeline stage (as Megatron-Core places it), under TP / SP / EP
for its weights (conversion, checkpoints, export); `mtp_logits` runs on one stage holding the
embedding and the output layer, TP 1; context parallelism is refused in one line.
"""

from __future__ import annotations

import copy

import torch

from megatron_gspo.convert.mtp import declared_mtp_layers


class MTPBuildError(ValueError):
    """MTP layers asked for where this build cannot place them."""


def mtp_layer_spec(block_spec):
    """The layer spec of the MTP layers' transformer layer: that of the model's last decoder
    layer kind (MoE for DeepSeek-V3 / GLM-4.5, whose MTP layer index >= first_k_dense_replace)."""
    specs = getattr(block_spec, "layer_specs", None)
    return specs[-1] if specs else block_spec


def attach_mtp(model, config, block_spec, use_te: bool, num_layers: int, vp_stage=None):
    """Build Megatron-Core's MTP block and attach it as ``model.mtp`` (frozen).

    Args:
        model: the GPTModel (nothing is built unless it is the last stage).
        config: its TransformerConfig.
        block_spec: the decoder's block spec (TransformerBlockSubmodules or a layer spec).
        use_te: the spec backend.
        num_layers: MTP layers to build.
        vp_stage: virtual pipeline stage (None).
    Returns:
        the block (None on other stages).
    """
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec,
    )

    if not model.post_process:
        return None  # Megatron-Core places every MTP layer on the last pipeline stage
    if config.context_parallel_size > 1:
        raise MTPBuildError("MTP layers under context parallelism are not supported yet")
    cfg = copy.copy(config)
    cfg.mtp_num_layers = num_layers
    cfg.mtp_loss_scaling_factor = 0.0
    # no full recompute of the head (one layer): Megatron-Core's checkpointed MTP forward hands
    # PackedSeqParams to save_for_backward, which refuses it (0.16.1, packed rows)
    cfg.recompute_granularity = None
    layer = get_mtp_layer_spec(mtp_layer_spec(block_spec), use_transformer_engine=use_te)
    if config.sequence_parallel and not use_te:  # the torch norm refuses SP
        from megatron_gspo.megatron.models.local_layers import SequenceParallelRMSNorm

        sub = layer.submodules
        sub.enorm = sub.hnorm = sub.layer_norm = SequenceParallelRMSNorm
    spec = MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * num_layers)
    block = MultiTokenPredictionBlock(config=cfg, spec=spec, vp_stage=vp_stage,
                                      pg_collection=getattr(model, "pg_collection", None))
    for p in block.parameters():
        p.requires_grad_(False)
    model.mtp = block
    return block


@torch.no_grad()
def init_added_mtp(model) -> int:
    """Initialise MTP layers added to a model that shipped without (`model.mtp_layers: add`).

    Each layer starts as a continuation of the trunk: its transformer layer a copy of the last
    decoder layer, its final norm (``shared_head.norm``) a copy of the decoder's final norm,
    enorm and hnorm ones, and eh_proj = [0 | I], which passes the renormalised hidden state
    hnorm(h_i) through and ignores the next token's embedding. Reasoning: the head's input is
    then a residual stream of the kind the copied layer, the final norm and the shared output
    layer were trained on, so it starts as a trained function (the trunk's next-token view one
    layer deeper) rather than a random one, its activations and gradients at the scale the
    trunk's weights expect, and the optimizer adapts it instead of building it; a zero eh_proj
    would carry no signal and a random one would scramble the hidden state. The embedding half
    of eh_proj is zero but gets gradient from the first step (its input enorm(Emb(t_{i+1})) is
    not zero), so the head learns to use the next token. Measured on the tiny demo's rollouts
    (docs/model-families.md, MTP): step 0 agreement with the sampled t_{i+2} 9%, 5.3 nats
    (confident where wrong: above the uniform 4.85), falling from there. Later layers take the
    same start.

    Args:
        model: GPTModel (wrappers allowed) with ``mtp`` (`attach_mtp`), weights loaded.
    Returns:
        parameters written (0 on a stage without the block).
    """
    while hasattr(model, "module"):
        model = model.module
    block = getattr(model, "mtp", None)
    if block is None:
        return 0
    if model.config.tensor_model_parallel_size > 1:
        raise MTPBuildError("adding MTP layers under tensor parallelism is not supported yet")
    last = model.decoder.layers[-1]
    src = dict(last.named_parameters()) | dict(last.named_buffers())
    norm = model.decoder.final_layernorm
    n = 0
    for layer in block.layers:
        inner = getattr(layer, "transformer_layer", None) or layer.mtp_model_layer  # 0.19 name
        for name, t in list(inner.named_parameters()) + list(inner.named_buffers()):
            if name in src and src[name].shape == t.shape:
                t.copy_(src[name])
                n += 1
        for name, p in layer.named_parameters():
            if name.startswith(("enorm.", "hnorm.")):
                p.fill_(1.0)
            elif name.startswith("final_layernorm."):
                p.copy_(dict(norm.named_parameters())[name.split(".", 1)[1]])
            elif name == "eh_proj.weight":  # [H, 2H]: [0 | I] on [enorm(emb); hnorm(h)]
                H = p.shape[0]
                p.zero_()
                p[:, H:].copy_(torch.eye(H, dtype=p.dtype, device=p.device))
            else:
                continue
            n += 1
    return n


def num_mtp_layers(hf_config: dict, requested: bool) -> int:
    """MTP layers to build: the config's ``num_nextn_predict_layers`` when `requested`."""
    return declared_mtp_layers(hf_config) if requested else 0


def mtp_logits(model, tokens: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of each MTP layer (k = 1..D predicts token i + k + 1 at position i).

    Args:
        model: GPTModel with ``model.mtp`` (`attach_mtp`).
        tokens, position_ids: [B, S].
    Returns:
        D tensors [B, S, V_pad]; the last k positions of layer k see a rolled-in token 0.
    """
    while hasattr(model, "module"):  # DDP / Float16Module wrappers
        model = model.module
    if getattr(model, "mtp", None) is None or not model.pre_process:
        raise MTPBuildError("mtp_logits needs a model with MTP layers and its embedding on one "
                            "stage (pipeline parallelism: not supported yet)")
    if model.config.tensor_model_parallel_size > 1:
        raise MTPBuildError("mtp_logits under tensor parallelism is not supported yet")
    seen = {}
    hook = model.decoder.register_forward_hook(lambda m, a, out: seen.update(h=out))
    try:
        model(tokens, position_ids, None)
    finally:
        hook.remove()
    h = seen["h"][0] if isinstance(seen["h"], tuple) else seen["h"]  # [S, B, H], final-normed
    rope = None
    if getattr(model, "rotary_pos_emb", None) is not None and not getattr(
            model.config, "multi_latent_attention", False):
        rope = model.rotary_pos_emb(tokens.shape[1])
    out = model.mtp(input_ids=tokens, position_ids=position_ids, hidden_states=h,
                    attention_mask=None, rotary_pos_emb=rope, embedding=model.embedding)
    chunks = torch.chunk(out, 1 + len(model.mtp.layers), dim=0)[1:]
    tied = model.share_embeddings_and_output_weights
    weight = model.shared_embedding_or_output_weight() if tied else None
    return [model.output_layer(c, weight=weight)[0].transpose(0, 1) for c in chunks]
