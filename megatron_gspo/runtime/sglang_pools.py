"""How SGLang 0.5.23 sizes its memory pools for a hybrid linear-attention model (Qwen3.5,
Qwen3-Next: gated delta-net layers beside full-attention layers), from numbers alone.

Read from sglang/srt/ of 0.5.23 (paths below are relative to it). A colocated server starts
with `--enable-memory-saver`, which turns post-capture KV sizing off
(arg_groups/overrides.py, `post_capture_kv_sizing_planned`: `if cfg.enable_memory_saver:
return False`), so the pools are sized once, before CUDA graphs, by
mem_cache/kv_cache_configurator.py:

1. `_profile_available_bytes`: rest = free now - free at launch x (1 - mem_fraction_static)
   (no multimodal reservation for the text model, `mm_runtime_reservation_gb`); with the
   weights loaded, rest = free x f - weights, as for a dense model;
2. `_handle_max_mamba_cache` (the delta-net state, a `MambaPool` of conv + recurrent state
   per request slot, mem_cache/memory_pool.py, allocated with `size + 1` slots):
   - `--max-mamba-cache-size N`: N slots;
   - else `--disable-radix-cache` with `--max-running-requests R`: R slots;
   - else (the default) the budget rest x r / (1 + r), r = `--mamba-full-memory-ratio`
     (arg_groups/fields/schedule.py: fallback 0.9), gives N = (budget - slot) // slot;
   the state then takes (N + 1) x slot and the KV cache gets what is left;
3. `config_from_budget` -> model_executor/pool_configurator.py `DefaultPoolConfigurator`:
   KV tokens = left // cell, rounded down to `page_size`, where the cell counts only the
   full-attention layers (`mambaish.full_attention_layer_ids`): max(1, kv_heads // tp) x
   (head_dim + v_head_dim) x full layers x kv bytes;
4. `resolve_max_num_reqs`: requests = min(R or clamp(tokens / context_len x 512, 2048, 4096),
   tokens // 2), then capped at N // ratio state slots per request, ratio =
   `_calculate_mamba_ratio`: 1 without radix cache, else 3 (MAMBA_CACHE_SIZE_MAX_RUNNING_
   REQUESTS_RATIO) + the extra-buffer tracking slots (mem_cache/allocation_sizing.py
   `get_mamba_tracking_slots`: 2 with the overlap schedule, 1 without). The strategy "auto"
   resolves to extra_buffer for Qwen3.5 / Qwen3-Next on CUDA with the overlap schedule
   (arg_groups/overrides.py `_mamba_radix_cache_resolution`), so the default ratio is 5.
   SGLang refuses to start when that is 0 ("state cache is too small to serve any requests").

The slot size is `BaseLinearStateParams.mamba_cache_per_req` (configs/mamba_utils.py) with
the shape of configs/qwen3_next.py `mamba2_cache_params` (Qwen3.5's text config subclasses
Qwen3NextConfig, configs/qwen3_5.py): per linear layer a conv state [conv_dim / tp, kernel - 1]
in bfloat16 (SGLANG_MAMBA_CONV_DTYPE) and a recurrent state [value_heads / tp, value_dim,
key_dim] in `mamba_ssm_dtype` (float32 unless the config, --mamba-ssm-dtype or
SGLANG_MAMBA_SSM_DTYPE says otherwise), conv_dim = 2 x key_heads x key_dim + value_heads x
value_dim. Not modelled: speculative decoding's intermediate state, ReplaySSM rings, pipeline
parallel servers, unified memory pools. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RATIO_DEFAULT = 0.9  # --mamba-full-memory-ratio's fallback (arg_groups/fields/schedule.py)
BASE_SLOTS = 3  # MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO (kv_cache_configurator.py)


def sglang_kv_tokens(free_bytes: int, weight_bytes: int, mem_fraction: float,
                     cell_bytes: int) -> int:
    """KV-cache tokens SGLang 0.5.12 allocates at launch: (free x f - weights) // cell (0 when
    that is negative: SGLang then refuses to start)."""
    return max(0, int(free_bytes * mem_fraction - weight_bytes) // cell_bytes)


def gdn_state_bytes(*, linear_layers: int, key_heads: int, value_heads: int, key_dim: int,
                    value_dim: int, conv_kernel: int, tp: int, ssm_dtype: str = "float32",
                    conv_dtype: str = "bfloat16") -> int:
    """One request slot of SGLang's MambaPool on one TP rank: conv + recurrent state of every
    gated delta-net layer (`mamba_cache_per_req`, shapes of `Mamba2StateShape.create`)."""
    groups = key_heads
    if groups % tp:  # extra_groups_for_head_shards: groups replicated to follow the heads
        groups += tp - groups
    conv_dim = value_heads * value_dim + 2 * groups * key_dim
    conv = conv_dim // tp * (conv_kernel - 1) * DTYPE_BYTES[conv_dtype]
    ssm = value_heads // tp * value_dim * key_dim * DTYPE_BYTES[ssm_dtype]
    return (conv + ssm) * linear_layers


@dataclass(frozen=True)
class ServerKnobs:
    """The SGLang flags that size a hybrid model's pools (None: SGLang's default)."""

    max_running_requests: int | None = None
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float | None = None
    mamba_ssm_dtype: str | None = None
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    page_size: int = 1
    context_length: int | None = None

    @classmethod
    def from_argv(cls, argv) -> ServerKnobs:
        """The knobs in extra server arguments (`--flag value` or `--flag=value`)."""
        args, it = {}, iter(list(argv))
        for a in it:
            if not a.startswith("--"):
                continue
            key, eq, value = a[2:].partition("=")
            key = key.replace("-", "_")
            if key in ("disable_radix_cache", "disable_overlap_schedule"):
                args[key] = True
            elif key in cls.__dataclass_fields__:
                args[key] = value if eq else next(it, "")
        kinds = {"max_running_requests": int, "max_mamba_cache_size": int, "page_size": int,
                 "context_length": int, "mamba_full_memory_ratio": float}
        try:
            return cls(**{k: kinds.get(k, lambda v: v)(v) for k, v in args.items()})
        except ValueError as e:
            raise ValueError(f"rollout.extra_server_args: {e}") from None

    def slots_per_request(self) -> int:
        """`_calculate_mamba_ratio`: state slots one running request holds."""
        if self.disable_radix_cache:
            return 1
        return BASE_SLOTS + (1 if self.disable_overlap_schedule else 2)


@dataclass(frozen=True)
class HybridPools:
    """What one server rank allocates: KV tokens, state slots (the padding slot excluded),
    their bytes, and the requests it runs at once."""

    kv_tokens: int
    state_slots: int
    kv_bytes: int
    state_bytes: int
    max_running_requests: int


def hybrid_pools(free_bytes: int, weight_bytes: int, mem_fraction: float, cell_bytes: int,
                 state_bytes_per_request: int, context_len: int,
                 knobs: ServerKnobs = ServerKnobs()) -> HybridPools:
    """SGLang 0.5.23's pools of a hybrid linear-attention model (module docstring, steps
    1-4). A non-positive slot count or request count is returned as is (SGLang refuses)."""
    rest = free_bytes * mem_fraction - weight_bytes
    per = state_bytes_per_request
    if knobs.max_mamba_cache_size is not None:
        slots = knobs.max_mamba_cache_size
    elif knobs.disable_radix_cache and knobs.max_running_requests is not None:
        slots = max(1, knobs.max_running_requests)
    else:
        r = RATIO_DEFAULT if knobs.mamba_full_memory_ratio is None else \
            knobs.mamba_full_memory_ratio
        slots = int((rest * r / (1 + r) - per) // per)
    state = (max(slots, 0) + 1) * per
    tokens = max(0, int(rest - state)) // cell_bytes // knobs.page_size * knobs.page_size
    estimated = max(min(int(tokens / context_len * 512), 4096), 2048)
    reqs = min(knobs.max_running_requests or estimated, tokens // 2)
    reqs = min(reqs, slots // knobs.slots_per_request())
    return HybridPools(kv_tokens=tokens, state_slots=slots, kv_bytes=tokens * cell_bytes,
                       state_bytes=state, max_running_requests=reqs)
