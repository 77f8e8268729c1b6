"""Megatron-Core version differences, in one place (supported: 0.16.1 through 0.19.x).

The rest of the package writes against one API and asks this module where releases differ;
nothing else branches on the Megatron-Core version. Each difference names the upstream file
that changed (paths under megatron/core/):

- Layer specs (models/gpt/gpt_layer_specs.py, `get_mlp_module_spec_for_backend`): up to 0.16 the
  MLP, MoE and expert entries of a layer spec are `ModuleSpec(module=..., submodules=...)`; 0.19
  builds them as `functools.partial(cls, submodules=...)`. `submodules(spec)` reads either.
- Checkpoint saves (dist_checkpointing/strategies/torch.py, `TorchDistSaveShardedStrategy`):
  from 0.17 a synchronous save runs `async_save(..., async_strategy="mcore")` and logs, once per
  process, "MCore's async save is deprecated ... set `async_strategy` to `nvrx`" although
  nothing is saved asynchronously. `quiet_logs()` drops that notice when a synchronous save
  logs it (an asynchronous save on the "mcore" strategy still shows it);
  `async_save_kwargs()` is what an asynchronous `dist_checkpointing.save` should pass, decided
  the way megatron-core decides (strategies/torch.py `HAVE_NVRX`, its `has_nvrx_async_support()`
  of strategies/nvrx.py: the NVRx names it needs and nvidia-resiliency-ext >= 0.6.0), else the
  built-in writer, said explicitly; `async_calls_queue` is the queue upstream pairs with it
  (`get_async_strategy`) and `close_async_queue` closes it with only the keywords its `close`
  takes (NVRx 0.4.1's has no `abort`).
- NVRx at import (dist_checkpointing/strategies/torch.py runs `has_nvrx_async_support()` while
  megatron.core is imported, from 0.17): with nvidia-resiliency-ext 0.4.0/0.4.1 installed it
  raises (AttributeError: the package has no `__version__`), so megatron.core cannot be imported
  at all. `nvrx_refusal()` runs that check from its file first and says so in one line.
- MoE top-k order (transformer/moe/moe_utils.py, `topk_routing_with_score_function`): from
  0.18 the router's top-k is sorted only while grad is enabled (`sorted=torch.is_grad_enabled()`),
  so indices taken under no_grad come in another order than a training forward's, and a replay
  of them (r2) gathers the same experts' probabilities in another order: gradients off by
  roundoff. `sorted_topk_indices` takes them the way a training forward does, on every release.
- Notices no user can act on: 0.19's GPTModel logs "GPTModel IS DEPRECATED" (models/gpt/
  gpt_model.py; GPTModel still builds and trains, HybridModel is upstream's next model class)
  at every model build, models/mimo/config/base_configs.py warns that MimoModelConfig is
  experimental at import, and transformer/transformer_config.py warns that its own default
  cuda-graph scope "full" is deprecated (`cuda_graph_scope` up to 0.16, `cuda_graph_modules` in
  0.19). `QUIET_WARNINGS` lists the warnings (fallbacks.quiet_fallback_warnings filters them),
  `quiet_logs()` the log records.
- DeepSeek Sparse Attention (transformer/experimental_attention_variant/dsa.py): 0.16.1's
  `DSAIndexer` rotates q and k by a Hadamard transform unconditionally (dsa.py:591-592), which
  asserts bf16 and the CUDA package fast_hadamard_transform (dsa.py:41-44): no fp32 / CPU path.
  0.19 makes it optional (`dsa_indexer_rotate_activation`) and adds the rope layout, k_norm eps and
  top-k sharing fields. `dsa_torch_path()` says whether the installed release has them.
- MTP layer names (transformer/multi_token_prediction.py, `MultiTokenPredictionLayer`): the
  transformer layer of an MTP layer is ``transformer_layer`` up to 0.16, ``mtp_model_layer`` in
  0.19 (so the parameter names, and a torch_dist checkpoint's keys, differ between releases).
  `canonical_mtp_name` spells either as ``transformer_layer``, the conversion maps' name.
- Refusals that exist because of an upstream limit (`REFUSALS`): each names the upstream line,
  the first release that lifts it (None: none up to 0.19.2, nor Megatron-LM main of
  2026-08-22), and `refusal(name)` says whether the installed release still has it.
  tests/megatron/test_compat.py reads the installed source: when a release changes the named
  line, the test fails until the refusal is re-measured and `fixed_in` set.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = ">=0.16.1,<0.20"  # pyproject.toml's range; README "Supported versions"

QUIET_WARNINGS = (
    r"full scope is deprecated\. Use empty cuda_graph_(scope|modules)",
    r"MimoModelConfig is experimental",
)

_SYNC_SAVE_NOTICE = "MCore's async save is deprecated"
_QUIET_LOGS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
)


def version() -> tuple[int, int, int]:
    """The installed megatron-core release as (major, minor, patch); (0, 0, 0) when it is not
    installed. Reads package metadata only (imports nothing)."""
    try:
        text = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return (0, 0, 0)
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise RuntimeError(f"megatron-core: cannot read its version {text!r}")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def version_text() -> str:
    """'megatron-core X.Y.Z' of the installed release."""
    return "megatron-core " + ".".join(map(str, version()))


def submodules(spec):
    """The `submodules` of a layer-spec entry: a ModuleSpec's attribute (0.16) or the keyword of
    a `functools.partial(cls, submodules=...)` (0.19, models/gpt/gpt_layer_specs.py). The object
    returned is the one the spec builds from: assigning its fields changes the spec."""
    if hasattr(spec, "submodules"):
        return spec.submodules
    keywords = getattr(spec, "keywords", None)
    if keywords is not None and "submodules" in keywords:
        return keywords["submodules"]
    raise TypeError(f"layer spec entry {spec!r} has no submodules")


def dsa_torch_path() -> bool:
    """The installed release's DSA indexer can run without the CUDA-only Hadamard rotation
    (TransformerConfig has `dsa_indexer_rotate_activation`, 0.19+)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    return "dsa_indexer_rotate_activation" in {f.name for f in dataclasses.fields(
        TransformerConfig)}


_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.")


def canonical_mtp_name(name: str) -> str:
    """A parameter name of Megatron-Core's MTP block with its transformer layer spelled
    ``transformer_layer`` (0.16.1's name; 0.19's ``mtp_model_layer`` is renamed)."""
    return _MTP_LAYER.sub(r"\1transformer_layer.", name, count=1)


def async_save_kwargs() -> dict:
    """Keyword arguments of an asynchronous `dist_checkpointing.save(...,
    async_sharded_save=True)`: none before 0.17 (one built-in writer); from 0.17
    (dist_checkpointing/serialization.py `save(async_strategy=...)`) "nvrx" where megatron-core
    itself found NVRx usable (strategies/torch.py `HAVE_NVRX`), else the built-in "mcore"
    writer, which upstream marks deprecated."""
    if version() < (0, 17, 0):
        return {}
    from megatron.core.dist_checkpointing.strategies import torch as strategies

    return {"async_strategy": "nvrx" if strategies.HAVE_NVRX else "mcore"}


def async_calls_queue(kwargs: dict):
    """The `AsyncCallsQueue` class that runs saves made with `kwargs` (`async_save_kwargs()`):
    upstream's pairing (strategies/torch.py `get_async_strategy`, 0.17+), else the built-in
    one (strategies/async_utils.py)."""
    if "async_strategy" not in kwargs:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        return AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

    return get_async_strategy(kwargs["async_strategy"], "AsyncCallsQueue")[1]


def close_async_queue(queue) -> bool:
    """Close `queue` without finalizing its pending saves: `close(abort=True)` where its `close`
    takes `abort` (megatron-core's); a `close()` without it (NVRx 0.4.1) finalizes, a
    collective that publishes a save of an ended run, so it is called only on an empty queue.

    Returns:
        whether `close` was called.
    """
    if "abort" in inspect.signature(queue.close).parameters:
        queue.close(abort=True)
        return True
    if queue.get_num_unfinalized_calls():
        return False  # a forked writer left running ends with this process (child_procs)
    queue.close()
    return True


def _mcore_file(relative: str) -> Path | None:
    """megatron/core/`relative` of the installed megatron-core, found without importing it."""
    spec = importlib.util.find_spec("megatron")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "core" / relative
        if path.is_file():
            return path
    return None


def nvrx_refusal() -> str | None:
    """One line saying why megatron.core cannot be imported beside the installed
    nvidia-resiliency-ext, or None (it can, or NVRx is absent). Runs megatron-core's own
    import-time check (dist_checkpointing/strategies/nvrx.py `has_nvrx_async_support`, 0.17+)
    loaded from its file, so megatron.core itself is not imported."""
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        return None
    path = _mcore_file("dist_checkpointing/strategies/nvrx.py")
    if path is None:  # before 0.17: no import-time check
        return None
    spec = importlib.util.spec_from_file_location("_megatron_gspo_nvrx_check", path)
    check = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(check)
        check.has_nvrx_async_support()
    except Exception as e:  # noqa: BLE001 - what megatron.core's import would raise
        try:
            have = importlib.metadata.version("nvidia-resiliency-ext")
        except importlib.metadata.PackageNotFoundError:
            have = "(version unknown)"
        need = getattr(check, "NVRX_MIN_VERSION", "a newer release")
        cause = (str(e).splitlines() or [""])[0]
        return (f"{version_text()} cannot be imported beside nvidia-resiliency-ext {have}: its "
                f"NVRx check (megatron/core/dist_checkpointing/strategies/nvrx.py) raises "
                f"{type(e).__name__}: {cause}; uninstall it (pip uninstall "
                f"nvidia-resiliency-ext) or install nvidia-resiliency-ext>={need}")
    return None


def _in_sync_save() -> bool:
    """True when the caller's stack holds the strategy's synchronous `save` (which calls
    `async_save(..., "mcore")` and then runs the request at once)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "save" and code.co_filename.replace("\\", "/").endswith(
                "dist_checkpointing/strategies/torch.py"):
            return True
        frame = frame.f_back
    return False


class _QuietFilter(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...], sync_save: bool = False):
        super().__init__()
        self.prefixes, self.sync_save = prefixes, sync_save

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if any(msg.startswith(p) for p in self.prefixes):
            return False
        return not (self.sync_save and msg.startswith(_SYNC_SAVE_NOTICE) and _in_sync_save())


def quiet_logs() -> None:
    """Drop the log notices described in the module docstring (idempotent; other records of
    these loggers pass)."""
    targets = {name: (prefix,) for name, prefix in _QUIET_LOGS}
    targets.setdefault("megatron.core.dist_checkpointing.strategies.torch", ())
    for name, prefixes in targets.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietFilter) for f in logger.filters):
            logger.addFilter(_QuietFilter(prefixes, sync_save=name.endswith("strategies.torch")))


def sorted_topk_indices(compute_topk, scores, topk: int, num_groups=None, group_topk=None):
    """[N, k] top-k expert indices in the order a training forward's router takes them: the
    router's own `compute_topk(scores, topk, num_groups=..., group_topk=...)` run on detached
    scores with grad enabled (0.18+ sorts only then; builds no graph)."""
    import torch

    with torch.enable_grad():
        return compute_topk(scores.detach(), topk, num_groups=num_groups,
                            group_topk=group_topk)[1]


@dataclass(frozen=True)
class Refusal:
    """A layout the project refuses because of an upstream limit."""

    upstream_file: str  # under megatron/core/
    upstream_line: str  # the source line that makes it necessary (whitespace-normalised)
    reason: str  # "{version}" is filled with the installed release
    fixed_in: tuple[int, int, int] | None  # first release without the limit (None: none yet)


REFUSALS = {
    # MLA's shared rope key `k_pos_emb` meets only this rank's heads; its gradient is summed
    # over TP only by `gather_from_sequence_parallel_region`'s backward (reduce-scatter), i.e.
    # only with sequence parallelism (replicated down projections, TE's and the learner's local
    # spec). Without SP each rank keeps its own heads' part (TE spec too). Megatron-Core itself
    # refuses MoE + TP without SP; the local spec's column-parallel down projections (their
    # gathered output) lost that part also with SP: TP2+SP gradients ~1.5% off, now within 3e-8.
    "mla_tensor_parallel": Refusal(
        "transformer/multi_latent_attention.py",
        "if get_pg_size(self.tp_group) > 1 and self.config.sequence_parallel:",
        "{version}'s MLA sums the shared rope key's gradient over TP ranks only with sequence "
        "parallelism (transformer/multi_latent_attention.py gathers k_pos_emb with "
        "gather_from_sequence_parallel_region only when config.sequence_parallel)",
        None),
    # TransformerConfig.__post_init__ asserts it for every MoE model with linear biases.
    "moe_bias_expert_tensor": Refusal(
        "transformer/transformer_config.py",
        '), "Bias in Moe is only supported when ETP==1"',
        "{version} supports MoE expert biases only with expert tensor size 1 "
        "(transformer/transformer_config.py: \"Bias in Moe is only supported when ETP==1\")",
        None),
}


def refusal(name: str) -> str | None:
    """The reason `REFUSALS[name]` still applies to the installed release, or None when the
    installed release has the upstream fix."""
    r = REFUSALS[name]
    if r.fixed_in is not None and version() >= r.fixed_in:
        return None
    return r.reason.format(version=f"Megatron-Core {'.'.join(map(str, version()))}")
