"""The multi-token-prediction (MTP) draft head of the embedded engine: DeepSeek-V3's MTP module
(arXiv 2412.19437, section 2.2) on the Hugging Face side, as the learner runs it
(`megatron.models.mtp_block.mtp_logits`, Megatron-Core's `MultiTokenPredictionLayer`):

    h'_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])      # [enorm(emb); hnorm(h)] in that order
    o_i  = shared_head.norm(DecoderLayer(h'_i))             # at rotary position i (h_i's)
    q_i  = softmax(lm_head(o_i))                            # the draft of token i + 2

h_i is the target's last hidden state AFTER its final norm (Megatron-Core hands the decoder's
output, final layernorm included, to the MTP block; SGLang's NEXTN does the same). Emb and
lm_head are the target's own (shared). The decoder layer is the family's own class, built from
the target's config at layer index L = num_hidden_layers + k (MoE where the family's layer L is
MoE). Chained drafting (num_steps > 1) feeds o_i back as the next step's h with the drafted
token's embedding (Megatron-Core's block passes a layer's normed output to the next layer;
SGLang's EAGLE-on-MTP chains its one layer the same way).

Weights carry the checkpoint's HF names (`convert.mtp`): ``model.layers.{L}.enorm.weight``,
``hnorm.weight``, ``eh_proj.weight`` [H, 2H], ``shared_head.norm.weight`` and the decoder
layer's own names under ``model.layers.{L}.``; the copies ``embed_tokens`` /
``shared_head.head`` are not held (the target's are used).
"""

from __future__ import annotations

import copy
import os

import torch

from megatron_gspo.rollout.embedded_moe import fused_expert_slice

_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (`model.model`) of a causal LM."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers"):
        raise ValueError(f"MTP draft: {type(model).__name__} has no decoder stack `model.layers`")
    return base


class MTPDraft(torch.nn.Module):
    """One MTP layer of `target` (its config, embedding and head), randomly initialised until
    weights are loaded (`state_from`, `named_tensors`).

    Args:
        target: the causal LM the head drafts for (its embedding / lm_head are used, not held).
        k: the MTP layer's index (0 = the first; layer index num_hidden_layers + k).
    """

    def __init__(self, target: torch.nn.Module, k: int = 0) -> None:
        super().__init__()
        base = _base(target)
        cfg = target.config
        self.layer_index = int(cfg.num_hidden_layers) + k
        H, eps = int(cfg.hidden_size), float(getattr(cfg, "rms_norm_eps", 1e-6))
        norm_cls = type(base.norm)
        dtype = next(target.parameters()).dtype
        lcfg = copy.copy(cfg)  # per-layer type lists reach index L
        for key in ("layer_types", "mlp_layer_types"):
            types = getattr(lcfg, key, None)
            if isinstance(types, (list, tuple)) and len(types) <= self.layer_index:
                setattr(lcfg, key, list(types) + [types[-1]] * (self.layer_index + 1 - len(types)))
        self.block = type(base.layers[-1])(lcfg, layer_idx=self.layer_index)
        attn = getattr(self.block, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn.layer_idx = 0  # the draft's own one-layer cache
        self.enorm = norm_cls(H, eps=eps)
        self.hnorm = norm_cls(H, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = norm_cls(H, eps=eps)
        self.to(dtype=dtype, device=next(target.parameters()).device).eval()
        self._config = cfg
        # the target's modules, not registered here (a tuple): not this layer's parameters
        self._shared = (target.get_input_embeddings(), target.get_output_embeddings(),
                        base.rotary_emb)

    # ------------------------------------------------------------ weights
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer under its checkpoint name ``model.layers.{L}.*``."""
        p = f"model.layers.{self.layer_index}."
        out = {}
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            out[p + name.removeprefix("block.")] = t
        return out

    def param(self, name: str) -> torch.Tensor | None:
        """The tensor a checkpoint name denotes (per-expert names into fused experts)."""
        named = self.named_tensors()
        t = named.get(name)
        return t if t is not None else fused_expert_slice(named, name)

    def owns(self, name: str) -> bool:
        """`name` is one of this layer's checkpoint names (shared copies included)."""
        return name.startswith(f"model.layers.{self.layer_index}.")

    @torch.no_grad()
    def load_named(self, tensors: dict[str, torch.Tensor], strict: bool = True) -> int:
        """Copy checkpoint-named tensors of this layer in (the shared copies are skipped).

        Returns:
            tensors copied.
        Raises:
            KeyError / ValueError: unknown name or shape (one line); with `strict`, a tensor of
            the layer missing from `tensors`.
        """
        n, seen = 0, set()
        for name, t in tensors.items():
            if not self.owns(name) or name.endswith(_SHARED_COPIES):
                continue
            dst = self.param(name)
            if dst is None:
                raise KeyError(f"MTP draft: unknown tensor {name!r}")
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"MTP draft: {name} has shape {tuple(t.shape)}, the layer "
                                 f"expects {tuple(dst.shape)}")
            dst.copy_(t.to(dtype=dst.dtype, device=dst.device))
            seen.add(name)
            n += 1
        if strict:
            own = {k for k in self.named_tensors() if not k.endswith("e_score_correction_bias")}
            fused = any(".experts." in k for k in seen)
            missing = sorted(k for k in own - seen if not (fused and ".experts." in k))
            if missing:
                raise KeyError(f"MTP draft: the weights lack {missing[0]} "
                               f"({len(missing)} of the layer's tensors missing)")
        return n

    # ------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, cache=None) -> torch.Tensor:
        """Run the layer over S positions.

        Args:
            tokens: [B, S] the NEXT tokens t_{i+1} (their embedding enters).
            hidden: [B, S, H] the target's final-normed hidden states h_i (or the previous
                step's output when chaining).
            position_ids: [B, S] rotary positions (those of h_i).
            attention_mask: [B, past + S] 1 = a real slot (the cache's and these S).
            cache: the layer's own transformers cache (None: no cache, S is the whole sequence).
        Returns:
            [B, S, H] shared_head.norm of the layer's output (o_i; logits = `logits(o)`).
        """
        from transformers.masking_utils import create_causal_mask

        emb = self._shared[0](tokens)  # [B, S, H]
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))  # [B, S, H]
        mask = create_causal_mask(config=self._config, inputs_embeds=x,
                                  attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        rope = self._shared[2](x, position_ids)
        out = self.block(x, attention_mask=mask, position_ids=position_ids, cache=cache,
                         use_cache=cache is not None, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return self.shared_head.norm(out)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[.., H] -> [.., V]: the target's output head."""
        return self._shared[1](normed)


def mtp_tensors_in(path: str | os.PathLike, layer_index: int) -> dict[str, torch.Tensor]:
    """The tensors named ``model.layers.{layer_index}.*`` in a checkpoint directory's
    safetensors files ({} when it has none: a checkpoint without an MTP layer)."""
    from safetensors import safe_open

    prefix, out = f"model.layers.{layer_index}.", {}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118  (safe_open has no __iter__)
                if name.startswith(prefix):
                    out[name] = fh.get_tensor(name)
    return out
