"""Convert checkpoints between Hugging Face safetensors and Megatron-Core distributed format.

  hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N --dtype fp32|bf16|fp16] [--force]
  mcore-to-hf --ckpt DIR [--hf-config DIR] --out DIR [--dtype ...] [--max-shard-size GB]
              [--tp N --pp N --ep N] [--force]
  lora-to-peft --ckpt DIR [--base DIR] [--out DIR] [--merged DIR] [--dtype ...] [--force]
  hf-to-fp8 SRC DST [--keep-bf16-layers N] [--tp-size N] [--force]

Without torchrun the needed local processes are started here; under torchrun the launcher's
ranks are used (WORLD_SIZE must be a multiple of what the layout needs). Exit code 0 on
success, 1 on bad input (one-line error) with no output directory left behind.

mcore-to-hf also takes the trainer's run checkpoints (runs/NAME/checkpoints/step_N), verified
against their COMPLETE marker. A --hf-config that describes another model than the checkpoint
(stored config or tensor shapes), or an --out that is, contains or lies inside an input, is
refused. Temp directories of killed conversions are removed by the next conversion writing
into the same directory.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager


def _parser(prog: str | None = "megatron-gspo convert") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron-Core dist checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory")
    a.add_argument("--out", required=True, help="checkpoint directory to create")
    a.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16 (default fp32)")
    b = sub.add_parser("mcore-to-hf", help="Megatron-Core dist checkpoint -> HF safetensors")
    b.add_argument(
        "--ckpt",
        required=True,
        help="converted checkpoint, or a run checkpoint (runs/NAME/checkpoints/step_N, its "
        "model/ folder, or the run / checkpoints directory: newest complete checkpoint)",
    )
    b.add_argument(
        "--hf-config",
        default=None,
        help="directory with config.json/tokenizer, checked against the checkpoint (default: "
        "the config stored with the checkpoint; tokenizer files from CKPT/hf_config or the "
        "run's model.path)",
    )
    b.add_argument("--out", required=True, help="HF directory to create")
    b.add_argument("--dtype", default=None, help="output dtype (default: checkpoint's)")
    b.add_argument("--max-shard-size", type=float, default=5.0, help="GB per safetensors shard")
    c = sub.add_parser("lora-to-peft", help="LoRA run checkpoint -> PEFT adapter directory "
                       "(adapter_config.json + adapter_model.safetensors) and/or merged HF model")
    c.add_argument("--ckpt", required=True, help="a LoRA run checkpoint (as for mcore-to-hf)")
    c.add_argument("--base", default=None, help="HF base model directory (default: the base "
                   "named in the checkpoint's lora.json)")
    c.add_argument("--out", default=None, help="PEFT adapter directory to create")
    c.add_argument("--merged", default=None, help="HF directory for the merged model "
                   "(base + scale * B A)")
    c.add_argument("--dtype", default=None, help="output dtype (default fp32)")
    c.add_argument("--force", action="store_true", help="replace existing output directories")
    f = sub.add_parser("hf-to-fp8", help="HF safetensors -> block-wise FP8 HF checkpoint (e4m3, "
                       "128x128 blocks, fp32 weight_scale_inv; the DeepSeek-V3 / Qwen3-FP8 format "
                       "SGLang's fp8 method loads)")
    f.add_argument("src", metavar="SRC", help="HF model directory (BF16 / FP32 safetensors)")
    f.add_argument("dst", metavar="DST", help="FP8 HF directory to create")
    f.add_argument("--keep-bf16-layers", type=int, default=0, metavar="N",
                   help="keep the first and last N decoder layers unquantized (default 0); "
                   "embeddings, lm_head, norms and routers always are")
    f.add_argument("--tp-size", type=int, default=1, metavar="N",
                   help="tensor-parallel size of the servers that will load it: a weight whose "
                   "per-GPU part is not whole 128x128 blocks stays unquantized (default 1)")
    f.add_argument("--force", action="store_true", help="replace an existing DST")
    for s in (a, b):
        s.add_argument("--tp", type=int, default=1, help="tensor parallel size")
        s.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
        s.add_argument("--ep", type=int, default=1, help="expert parallel size")
        s.add_argument("--force", action="store_true", help="replace an existing --out")
        s.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


@contextmanager
def _held(ckpt: str):
    """`--ckpt` resolved to one run checkpoint (step_N) held against rotation while it is read
    (`checkpoint.hold_for_reading`); a converted checkpoint is passed through. A checkpoint
    removed before it could be held, or while it was read, is a one-line "retry" error."""
    from megatron_gspo.runtime.run_checkpoint import hold_for_reading
    from megatron_gspo.convert.param_map import ConversionError
    from megatron_gspo.convert.sources import resolve_checkpoint

    src = resolve_checkpoint(ckpt)
    if src.kind != "run":
        yield ckpt
        return
    gone = ConversionError(f"--ckpt {ckpt}: checkpoint {src.root} was removed while reading "
                           "(the training run rotated it away); retry")
    try:
        with hold_for_reading(src.root):
            try:
                yield str(src.root)
            except (ConversionError, OSError):
                if not (src.root / "COMPLETE").is_file():
                    raise gone from None
                raise
    except FileNotFoundError:
        raise gone from None


def main(argv: list[str] | None = None, prog: str | None = "megatron-gspo convert") -> int:
    """Entry of `megatron-gspo convert` and tools/convert_checkpoint.py; returns the exit code.

    Args:
        argv: the arguments (default: sys.argv[1:]).
        prog: the program name in usage lines (None: the script's file name).
    """
    args = _parser(prog).parse_args(argv)
    from megatron_gspo.convert.param_map import ConversionError
    from megatron_gspo.convert.guards import check_out_writable

    try:
        if args.cmd == "lora-to-peft":
            return _lora_to_peft(args)
        if args.cmd == "hf-to-fp8":
            return _hf_to_fp8(args)
        check_out_writable(args.out)  # before anything is read or loaded
        from megatron_gspo.megatron.io import conversion as conv

        world = conv.conversion_world_size(args.tp, args.pp, args.ep)
        dtype = conv.parse_dtype(args.dtype)
        common = {
            "tp": args.tp,
            "pp": args.pp,
            "ep": args.ep,
            "force": args.force,
            "progress": not args.no_progress,
        }
        if args.cmd == "hf-to-mcore":
            conv.check_hf_to_mcore(args.hf, args.out, args.force, (args.tp, args.pp, args.ep))
            conv.launch(
                conv.hf_to_mcore, world, hf_dir=args.hf, out=args.out, dtype=dtype, **common
            )
        else:
            if not 0 < args.max_shard_size < float("inf"):  # nan, inf: no shard size
                raise ConversionError(f"--max-shard-size must be a finite number > 0 (GB), got "
                                      f"{args.max_shard_size}")
            with _held(args.ckpt) as ckpt:  # a training run cannot rotate it away meanwhile
                _refuse_lora(ckpt)
                plan = conv.check_mcore_to_hf(ckpt, args.hf_config, args.out, args.force,
                                              (args.tp, args.pp, args.ep))
                conv.launch(
                    conv.mcore_to_hf,
                    world,
                    **plan,
                    out=args.out,
                    dtype=dtype,
                    max_shard_bytes=int(args.max_shard_size * 2**30),
                    **common,
                )
    except (ConversionError, ValueError, FileNotFoundError) as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 1
    print(f"convert_checkpoint: wrote {args.out}")
    return 0




def _refuse_lora(ckpt: str) -> None:
    from megatron_gspo.convert.param_map import ConversionError
    from megatron_gspo.convert.sources import resolve_checkpoint
    from megatron_gspo.megatron.lora.io import read_adapter_info

    if read_adapter_info(resolve_checkpoint(ckpt).dist_dir) is not None:
        raise ConversionError(f"--ckpt {ckpt}: a LoRA checkpoint (adapters only); use "
                              "`convert lora-to-peft` (PEFT adapter and/or --merged model)")


def _lora_to_peft(args) -> int:
    from megatron_gspo.convert.param_map import ConversionError
    from megatron_gspo.convert.guards import check_out_writable
    from megatron_gspo.megatron.io import conversion as conv
    from megatron_gspo.megatron.io.lora_to_peft import check_lora_to_peft, lora_to_peft

    if args.out is None and args.merged is None:
        raise ConversionError("lora-to-peft: pass --out (PEFT adapter) and/or --merged")
    for path in (args.out, args.merged):
        if path is not None:
            check_out_writable(path)
    with _held(args.ckpt) as ckpt:
        plan = check_lora_to_peft(ckpt, args.base, args.out, args.merged, args.force)
        conv.launch(lora_to_peft, 1, **plan, out=args.out, merged=args.merged,
                    dtype=conv.parse_dtype(args.dtype), force=args.force)
    print(f"convert_checkpoint: wrote {', '.join(p for p in (args.out, args.merged) if p)}")
    return 0


def _hf_to_fp8(args) -> int:
    """`convert hf-to-fp8`: written into a temp directory beside DST, renamed into place."""
    import shutil

    from megatron_gspo.convert.guards import check_out_disjoint, check_out_writable
    from megatron_gspo.convert.hf_io import commit_output_dir, prepare_output_dir
    from megatron_gspo.quant.fp8_checkpoint import write_fp8_checkpoint

    check_out_writable(args.dst)
    check_out_disjoint(args.dst, {"SRC": args.src}, out_flag="DST")
    tmp = prepare_output_dir(args.dst, args.force)
    try:
        qc = write_fp8_checkpoint(args.src, tmp, args.keep_bf16_layers, args.tp_size)
        commit_output_dir(tmp, args.dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"convert_checkpoint: wrote {args.dst} (block FP8 e4m3 128x128; "
          f"{len(qc['modules_to_not_convert'])} modules kept unquantized)")
    return 0
