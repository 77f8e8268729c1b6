"""Supervised pre-training and saving shared by the demos' pre-training scripts
(examples/tiny/pretrain.py, examples/multiturn_agent/pretrain.py).

`sft` is a plain, seeded torch loop (AdamW, linear warm-up then cosine decay to 10%, gradient
clipping at 1.0, cross-entropy with optional label smoothing on the unmasked targets), so
re-running a script reproduces the shipped model on the same torch build. `save_demo_model`
writes a Hugging Face model directory that transformers 4.x and 5.x and inference servers read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch


def sft(
    model: torch.nn.Module,
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    lr: float,
    label_smoothing: float = 0.0,
    on_step: Callable[[int, float], None] | None = None,
) -> float:
    """Train `model` on `steps` batches; returns the last loss.

    Args:
        model: a transformers causal LM (returns `.logits`).
        next_batch: () -> (ids [B, T], labels [B, T] with -100 where no loss is taken).
        steps, lr: optimizer steps and peak learning rate.
        label_smoothing: share of each target's probability spread over the vocabulary.
        on_step: called as on_step(step, loss) after every step (1-based), e.g. to evaluate.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)

    def lr_factor(s: int) -> float:  # linear warm-up, then cosine decay to 10%
        if s < warmup:
            return (s + 1) / warmup
        progress = (s - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    loss = torch.tensor(float("nan"))
    for step in range(1, steps + 1):
        ids, labels = next_batch()
        logits = model(input_ids=ids).logits[:, :-1]  # [B, T-1, V]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
            ignore_index=-100, label_smoothing=label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, loss.item())
    return loss.item()


def save_demo_model(model, tok, out: Path, *, eos_token_ids: list[int], chat_template: str) -> None:
    """Save model + tokenizer to `out` with a generation config stopping at `eos_token_ids`.

    The tokenizer_config.json names PreTrainedTokenizerFast and stores the chat template inline
    (transformers 4.x and 5.x both load it); config.json also carries a top-level rope_theta
    (readers built on transformers 4.x, e.g. inference servers, look for it there).
    """
    from transformers import GenerationConfig

    out = Path(out)
    model.generation_config = GenerationConfig(eos_token_id=eos_token_ids,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    tok_path = out / "tokenizer_config.json"
    cfg = json.loads(tok_path.read_text())
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if "extra_special_tokens" in cfg:
        cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens")
    cfg["chat_template"] = chat_template
    (out / "chat_template.jinja").unlink(missing_ok=True)
    tok_path.write_text(json.dumps(cfg, indent=2) + "\n")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
