"""FP8 rollouts (`rollout.weight_precision: fp8`): the rollout engines hold block-FP8 weights
(DeepSeek-V3's format, arXiv 2412.19437: e4m3, 128 x 128 blocks, fp32 inverse scales;
`quant.blockfp8`) while the learner trains in BF16.

- Launched SGLang servers start from an FP8 copy of `model.path`, written once per node into
  `RUN_DIR/fp8_model/node<N>` by the quantizer of `megatron-gspo convert hf-to-fp8`
  (`served_checkpoint`), and reused by a resumed or restarted run.
- Every sync sends what that checkpoint holds: each weight of an FP8 module quantized on the
  learner side, with its scale (`modules_kept` names the modules that stay BF16, the same list
  the checkpoint's config carries), on every path (`loop/weight_sync_phase.py`).
- The sync probe compares the servers' log-probs with the learner's BF16 recompute, so its
  tolerance grows by the quantization error (`probe_tolerance`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

from megatron_gspo.config import Config, ConfigError

#: The probe's largest per-token |log-prob| difference between an FP8 engine and the BF16
#: learner that still counts as a match. The tiny demo model's FP8 copy differs from it by up to
#: 0.41 per token (mean 0.018) on random sequences, more than one optimizer step moves it (0.19):
#: under FP8 the probe catches a wrong sync (FP8 bytes without their scales, a scale of the
#: wrong tensor, weights of another model) but not a sync missed by one step
#: (tests/loop/test_fp8_rollout.py).
FP8_PROBE_TOLERANCE = 1.0


def enabled(cfg: Config) -> bool:
    return cfg.rollout.weight_precision == "fp8"


def num_layers(hf_config: dict) -> int:
    """Decoder layers of a (text) model config."""
    text = hf_config.get("text_config") or hf_config
    if "num_hidden_layers" not in text:
        raise ConfigError("rollout.weight_precision: fp8 needs num_hidden_layers in the model's "
                          "config.json")
    return int(text["num_hidden_layers"])


@functools.lru_cache(maxsize=4)
def _kept(model_path: str, layers: int, keep_layers: int, tp_size: int) -> frozenset[str]:
    from megatron_gspo.quant.blockfp8 import modules_to_not_convert
    from megatron_gspo.rollout.served_shapes import checkpoint_shapes

    shapes = checkpoint_shapes(model_path)  # the safetensors headers only
    if not shapes:
        raise ConfigError(f"rollout.weight_precision: fp8 needs model.path's weights as "
                          f"safetensors; {model_path} has none readable")
    return frozenset(modules_to_not_convert(shapes, layers, keep_layers, tp_size))


def modules_kept(cfg: Config, hf_config: dict) -> frozenset[str]:
    """The modules whose weights stay BF16 on the servers (the served checkpoint's
    `modules_to_not_convert`): embeddings, lm_head, routers, the first and last
    `rollout.fp8_bf16_layers` layers, and weights (with their fused modules) whose part on one
    of `rollout.tp_size` server GPUs is not whole 128 blocks."""
    return _kept(str(cfg.model.path), num_layers(hf_config), cfg.rollout.fp8_bf16_layers,
                 cfg.rollout.tp_size)


def probe_tolerance(cfg: Config, tolerances: dict[str, float]) -> float:
    """The sync probe's tolerance: the learner dtype's, or FP8's when the servers hold FP8."""
    base = tolerances[cfg.model.dtype]
    return max(base, FP8_PROBE_TOLERANCE) if enabled(cfg) else base


def _source_record(cfg: Config) -> dict:
    src = Path(cfg.model.path)
    stamp = {f.name: [f.stat().st_size, int(f.stat().st_mtime)]
             for f in sorted(src.glob("*.safetensors"))}
    return {"source": str(src.resolve()), "files": stamp,
            "keep_bf16_layers": cfg.rollout.fp8_bf16_layers, "tp_size": cfg.rollout.tp_size}


def server_env(capability: tuple[int, int] | None = None) -> dict[str, str]:
    """Environment of launched FP8 servers. On compute capability 10+ (Blackwell) SGLang's
    DeepGEMM path requantizes each block-FP8 weight with power-of-two scales and packs the
    scales into int32 at load (0.5.12 fp8.py requant_weight_ue8m0_inplace, 0.5.23
    requant_block_scale_ue8m0_for_deepgemm), a layout the learner's fp32 scales do not fit:
    the servers run without it there (SGLANG_ENABLE_JIT_DEEPGEMM=0). Hopper keeps the
    checkpoint's tensors as they are and needs nothing.

    Args:
        capability: (major, minor) of the servers' GPU; default this process's GPU's.
    """
    if capability is None:
        import torch

        if not torch.cuda.is_available():
            return {}
        capability = torch.cuda.get_device_capability()
    return {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"} if capability[0] >= 10 else {}


def check_served(engine) -> None:
    """Refuse (one ConfigError naming the server) servers whose `/server_info` names a local
    model folder without block-FP8 weights: a BF16 model given FP8 weights and scales either
    dies loading them (a scale name SGLang's Qwen3 loader looks up unchecked) or casts the FP8
    bytes unscaled. Servers whose folder is not readable here are trusted."""
    from megatron_gspo.rollout.fp8_model import is_block_fp8_dir

    engine.sync(engine.astart())
    for url, info in getattr(engine, "server_info", {}).items():
        path = (info or {}).get("model_path")
        if path and os.path.isdir(path) and not is_block_fp8_dir(path):
            raise ConfigError(f"rollout.weight_precision: fp8, but the server at {url} serves "
                              f"{path}, which holds no block-FP8 weights (write its FP8 copy "
                              "with `megatron-gspo convert hf-to-fp8`)")


def this_node() -> int:
    """This process's node index under torchrun (global rank // ranks per node; 0 alone)."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return int(os.environ.get("RANK", "0") or 0) // local


def served_checkpoint(cfg: Config, run_dir: str | os.PathLike, node: int) -> str:
    """The FP8 folder launched servers on node `node` start from: `model.path` itself when it
    already is one, else `RUN_DIR/fp8_model/node<node>`, written (atomically: a temporary
    folder renamed) unless a complete copy of the same source and settings is there.

    Returns:
        the folder's path.
    """
    from megatron_gspo.quant.fp8_checkpoint import write_fp8_checkpoint
    from megatron_gspo.rollout.fp8_model import is_block_fp8_dir

    if is_block_fp8_dir(cfg.model.path):
        raise ConfigError(f"model.path: {cfg.model.path} holds FP8 weights; the learner trains "
                          "from the BF16 checkpoint (rollout.weight_precision: fp8 makes the "
                          "servers' FP8 copy)")
    out = Path(run_dir) / "fp8_model" / f"node{node}"
    record = _source_record(cfg)
    done = out / "fp8_source.json"
    if done.is_file():
        try:
            if json.loads(done.read_text()) == record:
                return str(out)
        except ValueError:
            pass
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_fp8_checkpoint(cfg.model.path, tmp, cfg.rollout.fp8_bf16_layers,
                             cfg.rollout.tp_size)
    except (OSError, ValueError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"rollout.weight_precision: fp8: writing the servers' FP8 copy of "
                          f"{cfg.model.path} failed: {e}") from None
    (tmp / "fp8_source.json").write_text(json.dumps(record))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return str(out)
