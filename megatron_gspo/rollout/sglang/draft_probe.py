"""The speculative draft's side of the weight sync (`sglang.speculative` says which SGLang path
reaches the draft at each release): the `LINK` call before a distributed sync, and the check
after a sync that every drafting server's draft holds what the learner sent.

The check (`acheck_draft`, part of the sync probe): SGLang's `/weights_checker` with
`{"action": "checksum", "selector": "draft"}` returns a checksum of each tensor of the draft
runners (keys ``draft.<name>``; SGLang 0.5.23 managers/scheduler_components/weight_updater.py
`check_weights`, utils/weight_checker.py `_compute_checksum`). The tensors compared are the MTP
layer's own ones that SGLang keeps unfused under the NEXTN renaming (``model.layers.{L}.enorm``
-> ``draft.model.enorm``; also hnorm, eh_proj, shared_head.norm: `SPEC_NAMES`), hashed here as
they are sent. A CPU server hashes with SHA-256 (managers/mm_utils.py `tensor_hash`), so its
checksums must equal ours; a GPU server hashes with a Triton kernel (`gpu_tensor_hash`), so
there the check is that a tensor the learner changed since the last sync has a new checksum.
The log-prob probe cannot see the draft: verification (rejection sampling) keeps the target's
distribution whatever the draft holds, a stale draft only lowers the acceptance.

Not verifiable: SGLang 0.5.12's `/weights_checker` reads the target only (managers/scheduler_
update_weights_mixin.py `check_weights`) and fails on a CPU server (its `torch.cuda.
synchronize()`); there the draft is kept right by the path itself (tensor and disk reach it, the
distributed path through `LINK`, refused without it: `speculative.link_refusal`), and
`draft_unverified` counts the servers left unchecked.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Iterable
from typing import Any

from megatron_gspo.convert.mtp import SPEC_NAMES  # SGLang's nextn_spec_weight_names
from megatron_gspo.rollout.engine import RolloutError
from megatron_gspo.rollout.sglang.speculative import (
    LINK,
    draft_link_needed,
    drafting,
    link_refusal,
)

def draft_key(name: str) -> tuple[int, str] | None:
    """(MTP layer index, SGLang draft checksum key) of an exported MTP tensor name, or None:
    ``model.layers.{L}.eh_proj.weight`` -> (L, ``draft.model.eh_proj.weight``)."""
    parts = name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    rest = parts[3]
    if not any(rest == s + ".weight" for s in SPEC_NAMES):
        return None
    return int(parts[2]), "draft.model." + rest


def tensor_checksum(t: Any) -> str:
    """SGLang's CPU `tensor_hash` of one tensor (managers/mm_utils.py: the first 8 bytes of the
    SHA-256 of its bytes), as utils/weight_checker.py `_hash_tensor` formats it (16 hex)."""
    import torch

    t = t.detach().cpu().contiguous()
    digest = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()
    return f"{int.from_bytes(digest[:8], byteorder='big', signed=False):016x}"


class DraftSync:
    """Mixin of `SGLangWeightSync`: uses the engine's `urls`, `server_info`, `tp_size`,
    `_post` and `serialize_entries`."""

    def note_draft(self, named: Iterable[tuple[str, Any]], path: str) -> None:
        """Record the checksums of the draft tensors among `named` (one bucket of this sync,
        as sent) and the sync's path (named in a failed check)."""
        sent = self.__dict__.setdefault("_draft_sent", {})
        self._draft_path = path
        for name, t in named:
            key = draft_key(name)
            if key is not None:  # SGLang's NEXTN draft serves the first MTP layer only
                layer, k = key
                if k not in sent or layer < sent[k][0]:
                    sent[k] = (layer, name, tensor_checksum(t))

    def note_draft_dir(self, model_path: str) -> None:
        """`note_draft` of the draft tensors a disk sync's checkpoint folder holds (nothing
        when the folder is not readable here: a path on the servers' machines, or a wrong one,
        which the servers then refuse themselves)."""
        from safetensors import safe_open

        self._draft_path = "disk"
        if not os.path.isdir(model_path):
            return
        for fname in sorted(os.listdir(model_path)):
            if fname.endswith(".safetensors"):
                with safe_open(os.path.join(model_path, fname), "pt") as f:
                    names = [n for n in f.keys() if draft_key(n) is not None]
                    self.note_draft([(n, f.get_tensor(n)) for n in names], "disk")
        self._draft_path = "disk"

    async def alink_drafts(self, version: int) -> None:
        """Before a distributed sync: refuse (one RolloutError naming the path) a drafting
        server whose broadcast would skip its draft, and post the empty `LINK` update to the
        ones that need it (`speculative.draft_link_needed`)."""
        infos = getattr(self, "server_info", {})
        for url in self.urls:
            bad = link_refusal(infos.get(url) or {}, url)
            if bad:
                raise RolloutError(f"weight sync to version {version} (distributed): {bad}")
        need = [u for u in self.urls if draft_link_needed(infos.get(u) or {})]
        if need:
            entries = self.serialize_entries([], version)
            await asyncio.gather(*(self._post(u, "/update_weights_from_tensor", {
                "serialized_named_tensors": entries, "load_format": LINK,
                "flush_cache": False}) for u in need))

    async def acheck_draft(self, version: int) -> dict[str, float]:
        """Check every drafting server's draft against what this sync sent (module docstring).

        Returns:
            {"draft_tensors_checked": n, "draft_unverified": servers that cannot report}.
        Raises:
            RolloutError: a draft that does not hold what was sent, one line naming the path.
        """
        sent = self.__dict__.pop("_draft_sent", {})
        path = getattr(self, "_draft_path", "?")
        prev = self.__dict__.setdefault("_draft_seen", {})
        infos = getattr(self, "server_info", {})
        checked, unverified = 0, 0
        for url in self.urls:
            info = infos.get(url) or {}
            if not drafting(info) or not sent:
                continue
            try:
                ans = await self._post(url, "/weights_checker",
                                       {"action": "checksum", "selector": "draft"})
            except RolloutError:
                ans = None
            ranks = (ans or {}).get("ranks") or []
            served = dict(ranks[0].get("checksums") or {}) if ranks else {}
            if not any(k.startswith("draft.") for k in served):
                unverified += 1  # SGLang 0.5.12: the checker reads the target only
                continue
            exact = info.get("device") == "cpu"  # SHA-256 there; a Triton hash on GPUs
            for key, (_, name, mine) in sorted(sent.items()):
                got = served.get(key)
                last = prev.get((url, key))
                stale = got is None or (got != mine if exact else (
                    last is not None and last[0] != mine and got == last[1]))
                if stale:
                    raise RolloutError(
                        f"weight sync to version {version} ({path}) did not reach the draft: "
                        f"{url}'s draft model holds {key} with checksum {got}, the learner "
                        f"sent {name} with {mine if exact else 'a change'}")
                prev[(url, key)] = (mine, got)
                checked += 1
        return {"draft_tensors_checked": float(checked), "draft_unverified": float(unverified)}
