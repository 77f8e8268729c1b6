"""The MoE pieces of the embedded engine: which modules are routers, the capture of their top-k
choices during generation (`Sample.routing`, what R3 replays), and the slice of one expert out
of a fused expert tensor when loading weights.
"""

from __future__ import annotations

import re

import torch

def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router of every MoE layer, in layer order (transformers' `*TopKRouter` /
    `*TopkRouter` (DeepSeek-V3, GLM-4.5) modules, whose forward returns (router logits, top-k
    weights, top-k expert indices)); dense layers have none."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


class RoutingCapture:
    """Forward hooks on the routers that keep each forward's top-k expert indices.

    Args:
        routers: the routers, in layer order (`moe_routers`).
    """

    def __init__(self, routers: list[torch.nn.Module]) -> None:
        self.forwards: list[torch.Tensor] = []  # per forward: [B, T, layers, k]
        self._current: list[torch.Tensor] = []
        self._hooks = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, module, args, output) -> None:
        self._current.append(output[2].detach().to(torch.int32))  # [B*T, k]

    def end_forward(self) -> None:
        """Close one model forward: stack its layers as [B, T, layers, k]."""
        per_layer = self._current
        self._current = []
        bsz_t, k = per_layer[0].shape
        self.forwards.append(torch.stack(per_layer, dim=1).reshape(bsz_t, len(per_layer), k))

    def rows(self, i: int, prompt_len: int, width: int, decoded: int) -> torch.Tensor:
        """Row `i`'s routing [prompt_len + decoded, layers, k]: its prompt positions of the
        (left-padded, `width` wide) prefill, then one position per decode forward."""
        first = self.forwards[0]
        bsz = first.shape[0] // width
        prefill = first.reshape(bsz, width, *first.shape[1:])[i, width - prompt_len:]
        steps = [f[i:i + 1] for f in self.forwards[1:1 + max(decoded, 0)]]
        return torch.cat([prefill, *steps], dim=0).cpu()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


_FUSED_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fused_expert_slice(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The slice of a fused expert tensor (transformers 5: `experts.gate_up_proj` [E, 2F, H] =
    [gate; up] per expert, `experts.down_proj` [E, H, F]) that a per-expert HF name
    (`experts.<e>.gate_proj.weight`, ...) denotes; None when `name` is not such a name."""
    m = _FUSED_EXPERT.match(name)
    if m is None:
        return None
    prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
    if which == "down_proj":
        fused = params.get(f"{prefix}.down_proj")
        return None if fused is None or e >= fused.shape[0] else fused[e]
    fused = params.get(f"{prefix}.gate_up_proj")
    if fused is None or e >= fused.shape[0]:
        return None
    half = fused.shape[1] // 2
    return fused[e, :half] if which == "gate_proj" else fused[e, half:]
