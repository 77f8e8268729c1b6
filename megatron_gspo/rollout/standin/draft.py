"""The stand-in server's speculative draft (`--speculative-algorithm NEXTN|EAGLE`): the NEXTN
draft model of a DeepSeek-V3 / GLM-4.5 checkpoint as SGLang holds it, for tests of the draft's
weight sync. It holds the MTP layer's own tensors (``model.layers.{num_hidden_layers}.*`` of the
checkpoint; the embedding and the head are the target's), loads them the way SGLang's NEXTN
loader does (models/deepseek_common/deepseek_weight_loader.py, models/glm4_moe.py
`load_weights(is_nextn=True)`: names outside the layer are skipped, a wrong shape asserts),
and answers `/weights_checker` checksums under SGLang's draft names.

Which weight path reaches it (`reaches_draft`), as upstream:
- tensor: yes, both releases (0.5.12 speculative/eagle_worker.py
  `EAGLEWorker.update_weights_from_tensor`: the draft runner, then the target; 0.5.23
  managers/scheduler_components/weight_updater.py `update_weights_from_tensor`: every runner);
  a custom loader is called with the draft model first, then the target.
- disk: yes, both (0.5.12 managers/scheduler_update_weights_mixin.py
  `update_weights_from_disk` calls the draft worker after the target; 0.5.23 weight_updater.py).
- distributed: only when acting as 0.5.23 (weight_updater.py `update_weights_from_distributed`
  loads the broadcast into every runner); as 0.5.12 the target only
  (scheduler_update_weights_mixin.py `update_weights_from_distributed`; sglang #27718), unless
  the project's `gspo_delta_loader.link_draft` linked the target's load_weights to the draft.
The stand-in does not draft tokens (generation is the target's alone): it reports no
`spec_*` meta_info, where the real server reports its acceptance.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from megatron_gspo.convert.mtp import SPEC_NAMES  # kept under model. (the rest: model.decoder)
from megatron_gspo.rollout.sglang.draft_probe import tensor_checksum

#: tensors of the MTP layer that SGLang's draft takes from the target instead
SHARED = ("embed_tokens", "shared_head.head")


class DraftNextN:
    """The draft model (its class name ends with NextN, as SGLang's draft classes do, which is
    how `gspo_delta_loader.link_draft` tells it from the target)."""

    def __init__(self, tensors: dict[str, torch.Tensor], first: int) -> None:
        self.tensors, self.first = tensors, first
        self.loads = 0  # load_weights calls that changed something

    def load_weights(self, weights: Any) -> None:
        named = [(n, t) for n, t in weights if n in self.tensors]
        for n, t in named:
            if tuple(t.shape) != tuple(self.tensors[n].shape):
                raise AssertionError(f"{n} has shape {tuple(t.shape)}, the draft "
                                     f"{tuple(self.tensors[n].shape)}")
        with torch.no_grad():
            for n, t in named:
                self.tensors[n].copy_(t.to(self.tensors[n].dtype))
        self.loads += bool(named)

    def served_name(self, name: str) -> str:
        """SGLang's draft parameter name of checkpoint name `name` (the NEXTN renaming)."""
        prefix = f"model.layers.{self.first}"
        inner = "model" if any(s in name for s in SPEC_NAMES) else "model.decoder"
        return inner + name[len(prefix):]

    def checksums(self) -> dict[str, str]:
        """As SGLang 0.5.23 utils/weight_checker.py `_compute_checksum` on a CPU runner of role
        "draft" (`_merge_checksum_payloads` prefixes the role): ``draft.<name>`` -> the first 8
        bytes of the SHA-256 of the tensor's bytes, as 16 hex digits (managers/mm_utils.py
        `tensor_hash`)."""
        return {"draft." + self.served_name(n): tensor_checksum(t)
                for n, t in self.tensors.items()}


def load_draft(model_path: str, dtype: torch.dtype) -> DraftNextN:
    """The draft of the checkpoint in `model_path`: its MTP layer's own tensors in `dtype`.

    Raises:
        ValueError: the checkpoint has no MTP layer (SGLang's draft loader finds none to load).
    """
    from safetensors import safe_open

    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        first = int(json.load(f)["num_hidden_layers"])
    prefix = f"model.layers.{first}."
    tensors: dict[str, torch.Tensor] = {}
    for fname in sorted(os.listdir(model_path)):
        if not fname.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(model_path, fname), "pt") as f:
            for name in f.keys():
                if name.startswith(prefix) and not any(s in name for s in SHARED):
                    tensors[name] = f.get_tensor(name).to(dtype).clone()
    if not tensors:
        raise ValueError(f"--speculative-algorithm: {model_path} has no tensor of an MTP layer "
                         f"({prefix}*) for the NEXTN draft")
    return DraftNextN(tensors, first)


def reaches_draft(path: str, acts_as_0523: bool) -> bool:
    """Whether SGLang's `path` update ("tensor", "disk", "distributed") loads into the draft
    model (see the module docstring)."""
    return path != "distributed" or acts_as_0523


class DraftEndpoints:
    """`/weights_checker` of the stand-in; the server provides `draft` (None without one),
    `engine`, `device`, `tp_size` and `weight_update_sessions` (acting as 0.5.23)."""

    async def weights_checker(self, request: Any) -> Any:
        """SGLang's `{"action": "checksum", "selector": ...}`. As 0.5.23 (entrypoints/
        http_server.py `check_weights`, managers/scheduler_components/weight_updater.py
        `check_weights`): the target's and the draft's tensors (draft keys prefixed), one
        ChecksumInfo per TP rank. As 0.5.12 (managers/scheduler_update_weights_mixin.py
        `check_weights`): the target's only, and on a CPU server the checker's opening
        `torch.cuda.synchronize()` (utils/weight_checker.py) fails: 400."""
        from aiohttp import web

        text = await request.text()
        body = json.loads(text) if text.strip() else {}
        if body.get("action", "checksum") != "checksum":
            return web.json_response({"success": False, "message": "Unsupported action="
                                      f"{body.get('action')!r} (the stand-in checksums only)"},
                                     status=400)
        if not self.weight_update_sessions:
            if self.device == "cpu":
                return web.json_response({"success": False, "message": "Found no NVIDIA "
                                          "driver on your system."}, status=400)
            selector = "target"
        else:
            selector = body.get("selector", "all")
        sums: dict[str, str] = {}
        if selector in ("target", "all"):
            sums.update({n: tensor_checksum(p) for n, p in self.engine.model.named_parameters()})
        if selector in ("draft", "all") and self.draft is not None:
            sums.update(self.draft.checksums())
        h = hashlib.sha256()
        for name in sorted(sums):
            h.update(name.encode())
            h.update(sums[name].encode())
        rank = {"checksums": sums, "per_gpu_checksum": h.hexdigest(),
                "parallelism_info": {"role": selector, "tp_rank": 0, "tp_size": self.tp_size}}
        return web.json_response({"success": True, "message": "Success.",
                                  "ranks": [dict(rank, parallelism_info=dict(
                                      rank["parallelism_info"], tp_rank=k))
                                            for k in range(self.tp_size)]})
