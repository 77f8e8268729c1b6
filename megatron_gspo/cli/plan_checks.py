"""Input checks of `megatron-gspo plan CONFIG` (the per-GPU memory plan of a run config;
arithmetic in `megatron.memory.report` / `megatron.memory.plan`).

Before the arithmetic the plan checks what training checks at start: the model config
(`--model-config`, default model.path; read up to `MAX_CONFIG_BYTES`, a JSON object) and the
parallel layout on `--nodes` x `--gpus-per-node` GPUs, with training's own functions
(`loop.early_checks.check_model_layout`), so that a layout training refuses never "fits".
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_gspo.config import ConfigError

MAX_CONFIG_BYTES = 16 * 2**20  # a config.json is kilobytes; /dev/zero would never end
UNKNOWN = "unknown"  # --gpu-memory of a launch that found no GPU: layout checks, no memory


def checked_model_config(cfg, args) -> dict:
    """The plan's flags checked (`--gpus-per-node`, `--nodes` >= 1, `--gpu-memory` > 0), the
    model config read (`read_model_config`) and checked with the layout the way training checks
    them at start.

    Returns:
        the model config (a dict).
    Raises:
        ConfigError naming the flag, file or field.
    """
    from megatron_gspo.loop.early_checks import check_model_layout
    from megatron_gspo.megatron.memory.report import parse_bytes

    for flag, value in (("--gpus-per-node", args.gpus_per_node), ("--nodes", args.nodes)):
        if value < 1:
            raise ConfigError(f"plan: {flag}: expected an integer >= 1, got {value}")
    if args.gpu_memory == UNKNOWN and not args.brief:
        raise ConfigError(f"plan: --gpu-memory {UNKNOWN} goes with --brief (the table needs a "
                          "size)")
    try:
        gpu_bytes = 1 if args.gpu_memory == UNKNOWN else parse_bytes(args.gpu_memory)
    except (ValueError, OverflowError) as e:
        raise ConfigError(f"plan: --gpu-memory: {e}") from None
    if gpu_bytes < 1:
        raise ConfigError(f"plan: --gpu-memory: {args.gpu_memory!r} is no memory; expected a "
                          "size such as 80GiB")
    src = Path(args.model_config or cfg.model.path or "")
    src = src / "config.json" if src.is_dir() else src
    hf = text_model_config(read_model_config(src))
    check_model_layout(cfg, hf, args.nodes * args.gpus_per_node, model=str(src))
    return hf


def text_model_config(hf: dict) -> dict:
    """A released Qwen3.5 vision-language config.json (`text_config` nested, architectures
    Qwen3_5(Moe)ForConditionalGeneration) as the text model the learner trains and SGLang
    serves: the config `python -m megatron_gspo.convert.qwen3_5 SRC DST` writes (vision tower
    and MTP layers left out). Any other config is returned as is."""
    from megatron_gspo.convert.qwen3_5 import TEXT_OF, text_config

    arch = (hf.get("architectures") or [None])[0]
    return text_config(hf) if arch in TEXT_OF and isinstance(hf.get("text_config"), dict) \
        else hf


def read_model_config(src: Path) -> dict:
    """A model's config.json as a dict: at most MAX_CONFIG_BYTES of UTF-8 JSON holding an
    object (ConfigError naming the file otherwise)."""
    try:
        with open(src, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"plan: model config {src}: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"plan: model config {src}: more than {MAX_CONFIG_BYTES >> 20} MiB, "
                          "not a config.json")
    try:
        hf = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"plan: model config {src}: not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"plan: model config {src}: a JSON {type(hf).__name__}, expected an "
                          "object of model settings")
    return hf


def launch_problems(cfg, nodes: int, gpus_per_node: int) -> list[str]:
    """What a launch of `cfg` on `nodes` x `gpus_per_node` GPUs would refuse at start-up before
    any memory is used: launched servers needing more GPUs than a node has
    (`rollout.sglang.launch.check_local_gpus`), and servers bound to loopback on a job whose
    nodes each launch their own (rank 0 on node 0 could not reach them)."""
    from megatron_gspo.rollout.sglang.launch import LaunchSpec, check_local_gpus

    r = cfg.rollout
    if r.engine != "sglang" or r.server_urls:
        return []
    out = []
    try:
        check_local_gpus(LaunchSpec(model_path=str(cfg.model.path), num_servers=r.num_servers,
                                    tp_size=r.tp_size), gpus_per_node)
    except ValueError as e:
        out.append(str(e))
    if r.speculative.algorithm == "mtp":  # launched servers that cannot draft from the head
        from megatron_gspo.rollout.sglang.speculative import speculative_server_args

        s = r.speculative
        try:
            speculative_server_args(_arch(cfg), s.num_steps, s.topk, s.num_draft_tokens,
                                    r.extra_server_args)
        except ValueError as e:
            out.append(str(e))
    loopback = r.host == "localhost" or r.host.startswith("127.") or r.host == "::1"
    if nodes > 1 and r.colocate and r.weight_sync in ("auto", "tensor") and loopback:
        out.append(f"rollout.host={r.host}: each of the {nodes} nodes launches its own servers "
                   "and node 0 could not reach the others'; set rollout.host: internal (each "
                   "node's cluster-internal address) or ROLLOUT_HOST")
    return out


def rollout_line(cfg) -> str:
    """The resolved rollout layout as key=value pairs (`plan --brief`, the launchers' dry
    runs)."""
    from megatron_gspo.megatron.memory.report import offload_learner_enabled

    r = cfg.rollout
    keys = [("engine", r.engine)]
    if r.engine == "sglang":
        keys += [("colocate", r.colocate)]
        if r.server_urls:
            keys += [("server_urls", ",".join(r.server_urls))]
        else:
            keys += [("num_servers", r.num_servers), ("tp_size", r.tp_size),
                     ("mem_fraction", r.mem_fraction), ("host", r.host),
                     ("base_port", r.base_port)]
        keys += [("weight_sync", r.weight_sync), ("weight_sync_delta", r.weight_sync_delta),
                 ("offload_learner", offload_learner_enabled(cfg))]
        if r.speculative.algorithm == "mtp":
            keys += _draft_keys(cfg)
    else:
        keys += [("dtype", r.dtype)]
    keys += [("group_size", r.group_size), ("max_new_tokens", r.max_new_tokens)]
    return "rollout: " + " ".join(
        f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys)


def _model_config(cfg) -> dict:
    """model.path's config.json, or {} where it cannot be read (a hub id)."""
    try:
        return read_model_config(Path(str(cfg.model.path)) / "config.json")
    except ConfigError:
        return {}


def _arch(cfg) -> str:
    return str((_model_config(cfg).get("architectures") or ["?"])[0])


def _draft_keys(cfg) -> list[tuple[str, object]]:
    """The speculative draft of launched servers: steps, top-k, and its memory per server
    (`speculative.draft_bytes`: one MTP layer's weights, its KV per token); not counted in
    the memory plan's moments."""
    from megatron_gspo.rollout.sglang.speculative import draft_bytes

    s = cfg.rollout.speculative
    keys: list[tuple[str, object]] = [("speculative", "mtp"), ("num_steps", s.num_steps),
                                      ("topk", s.topk)]
    hf = _model_config(cfg)
    try:
        width = 4 if cfg.model.dtype == "float32" else 2
        weights, kv = draft_bytes(hf, width, 1)
        keys += [("draft_weights_mib", round(weights / 2**20, 1)),
                 ("draft_kv_bytes_per_token", kv)]
    except (KeyError, TypeError, ValueError):
        pass  # a family without the MTP fields: the flags alone
    return keys
