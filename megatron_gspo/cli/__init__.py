"""Command line: `megatron-gspo train|config|plan|fields|study|convert`.

    megatron-gspo train CONFIG.yaml [--run-dir DIR] [section.key=value ...]
    megatron-gspo config CONFIG.yaml [section.key=value ...]   # print the resolved config
    megatron-gspo fields                                       # every config field with its doc
    megatron-gspo plan CONFIG.yaml [a.b=c ...] [--gpu-memory 80GiB] [--gpus-per-node 8]
                                                               # per-GPU memory plan, fits or not
    megatron-gspo study STUDY.yaml [--out DIR] [a.b=c ...]     # A/B arms of one config, summary
    megatron-gspo convert hf-to-mcore|mcore-to-hf ...          # same as tools/convert_checkpoint.py

Errors in the config or the data end the program with a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys

import yaml

from megatron_gspo import __version__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-gspo", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"megatron-gspo {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run GSPO training")
    t.add_argument("config", help="YAML config file")
    t.add_argument("--run-dir", default=None, help="output directory (default runs/<config>)")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides")
    c = sub.add_parser("config", help="print the resolved config")
    c.add_argument("config")
    c.add_argument("overrides", nargs="*")
    m = sub.add_parser("plan", help="per-GPU memory plan of a config (see megatron/memory/plan.py)")
    m.add_argument("config")
    m.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (default 80GiB)")
    m.add_argument("--gpus-per-node", type=int, default=8)
    m.add_argument("--nodes", type=int, default=1)
    m.add_argument("--model-config", default=None,
                   help="directory or config.json with the model's shape (default: model.path)")
    m.add_argument("--ledger-spec", default=None, metavar="PATH",
                   help="also write the device-memory ledger's spec of one GPU to PATH (a CPU "
                   "run with MEGATRON_GSPO_DEVICE_LEDGER=PATH reports what that GPU would hold)")
    m.add_argument("--brief", action="store_true",
                   help="print three lines (the resolved rollout layout, the learner layout, "
                   "the verdict with the changes that fit) instead of the table; the launch "
                   "scripts run this before torchrun")
    m.add_argument("overrides", nargs="*")
    f = sub.add_parser("fields", help="list every config field with its type, default and doc")
    f.add_argument("--markdown", action="store_true",
                   help="print the docs site's configuration reference page instead")
    s = sub.add_parser("study", help="run the arms of an A/B study (megatron_gspo/study/)")
    s.add_argument("study", help="study YAML file")
    s.add_argument("--out", default=None, help="output directory (default runs/study-<file>)")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides for every arm")
    v = sub.add_parser("convert", help="checkpoint conversion (see tools/convert_checkpoint.py)",
                       add_help=False)
    v.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _input_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input (data rows, rewards, checkpoints, samples, a chat template
    that cannot extend episodes): one line, exit 2."""
    from megatron_gspo.agent.chat_session import ChatTemplateError
    from megatron_gspo.convert.param_map import ConversionError
    from megatron_gspo.data.datasets import DatasetError
    from megatron_gspo.data.sample import SampleError
    from megatron_gspo.rewards import RewardError
    from megatron_gspo.megatron.models.builder import ModelConfigError  # e.g. a checkpoint's model
    from megatron_gspo.rollout.engine import RolloutError  # every sampled group failed, ...
    from megatron_gspo.runtime.device_ledger import LedgerSpecError  # a spec to read or write
    # run-dir lock, checkpoints, diverged training
    from megatron_gspo.runtime.rundir import RunError

    return (DatasetError, RewardError, ConversionError, SampleError, FileNotFoundError, RunError,
            ChatTemplateError, ModelConfigError, RolloutError, LedgerSpecError)


class OutputError(OSError):
    """Standard output cannot be written (a full disk or quota, a closed pipe)."""


def _emit(*parts, end: str = "\n") -> None:
    """print() to standard output, flushed; an OSError there becomes OutputError."""
    try:
        sys.stdout.write(" ".join(str(p) for p in parts) + end)
        sys.stdout.flush()
    except OSError as e:
        raise OutputError(e.errno, e.strerror) from None


def _output_failed(e: OutputError) -> int:
    """One line on stderr for a failed write to stdout (nothing for a closed pipe); stdout is
    pointed at /dev/null so that the interpreter's own flush at exit stays silent."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if e.errno == errno.EPIPE:
        return 1
    hint = " (full disk or quota?)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    print(f"megatron-gspo: cannot write to standard output: {e.strerror}{hint}",
          file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `megatron-gspo` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "convert":
        from megatron_gspo.cli.convert import main as convert_main

        return convert_main(argv[1:])
    parser = _parser()
    args, extra = parser.parse_known_args(argv)  # overrides may follow --run-dir
    bad = [a for a in extra if "=" not in a or a.startswith("-")]
    if bad or (extra and args.command not in ("train", "config", "study", "plan")):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    from megatron_gspo.config import Config, ConfigError, describe, load_config, to_dict

    try:
        if args.command == "fields" and args.markdown:
            from megatron_gspo.cli.reference import config_reference

            _emit(config_reference())
            return 0
        if args.command == "fields":
            for name, tp, default, doc in describe(Config):
                _emit(f"{name:40s} {tp:18s} {default!r:>14}  {doc}")
            return 0
        if args.command == "study":
            from megatron_gspo.study import run_study

            _emit(run_study(args.study, args.out, overrides=args.overrides))
            return 0
        cfg = load_config(args.config, args.overrides)
        if args.command == "config":
            _emit(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
            return 0
        if args.command == "plan":
            return _plan(cfg, args)
        from megatron_gspo.loop.train import run

        run(cfg, run_dir=args.run_dir, config_path=args.config)
        return 0
    except ConfigError as e:
        print(f"megatron-gspo: config error: {e}", file=sys.stderr)
        return 2
    except _input_errors() as e:
        print(f"megatron-gspo: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except OutputError as e:
        return _output_failed(e)
    except KeyboardInterrupt:
        print("megatron-gspo: interrupted", file=sys.stderr)
        return 130


def _plan(cfg, args) -> int:
    """`megatron-gspo plan`: print the table (or, with --brief, three lines); exit 1 when the
    layout does not fit or the launch would be refused."""
    from megatron_gspo.cli.plan_checks import (UNKNOWN, checked_model_config, launch_problems,
                                        rollout_line)
    from megatron_gspo.config import ConfigError
    from megatron_gspo.megatron.memory import changes as mc
    from megatron_gspo.megatron.memory import report as mr

    if args.ledger_spec is not None and (not args.ledger_spec.strip()
                                         or os.path.isdir(args.ledger_spec)):
        raise ConfigError(f"plan --ledger-spec: {args.ledger_spec!r} is "
                          f"{'a directory' if args.ledger_spec.strip() else 'empty'}; "
                          "name the file to write")
    hf = checked_model_config(cfg, args)  # the flags, and model and layout as training checks
    refused = launch_problems(cfg, args.nodes, args.gpus_per_node)
    if args.gpu_memory == UNKNOWN:  # a launch on a machine without a GPU it could count
        _emit(rollout_line(cfg))
        _emit(f"plan: refused: {'; '.join(refused)}" if refused else
              "plan: memory not checked: no GPU size (set GPU_MEMORY, or run where nvidia-smi "
              "lists the GPUs); layout checked")
        return 1 if refused else 0
    try:
        x = mr.inputs_from_config(cfg, hf, gpu_bytes=mr.parse_bytes(args.gpu_memory),
                                  gpus_per_node=args.gpus_per_node, nodes=args.nodes)
        plan = mr.build_plan(x)
        fix = None if plan.fits else mc.describe_changes(mc.fitting_changes(x))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"plan: {type(e).__name__}: {e}") from None
    if args.brief:
        _emit(rollout_line(cfg))
        _emit(f"learner: TP{x.tp} PP{x.pp} CP{x.cp} EP{x.ep} DP{x.dp} on {x.world} GPUs "
              f"({args.nodes} x {args.gpus_per_node}) of {x.gpu_bytes / mr.GiB:.1f} GiB")
        if refused:
            _emit(f"plan: refused: {'; '.join(refused)}")
        elif plan.fits:
            name, total, _ = max(plan.moments, key=lambda m: m[1])
            kv = f"; SGLang KV cache {plan.kv_tokens} tokens" if plan.kv_tokens else ""
            if plan.state_slots is not None:  # a hybrid: its delta-net state slots
                kv += (f", delta-net state {plan.state_slots} slots "
                       f"({plan.max_running_requests} requests at once)")
            _emit(f"plan: fits: largest moment {name} {total / mr.GiB:.1f} GiB "
                  f"({100 * total / plan.gpu_bytes:.0f}% of the GPU){kv}")
        else:
            _emit(f"plan: does not fit: {'; '.join(plan.problems)}; {fix}")
    else:
        _emit(mr.format_plan(plan, x, fix))
        for p in refused:
            _emit(f"refused at launch: {p}")
    if args.ledger_spec is not None:  # the device-memory ledger of one GPU of this plan
        mr.ledger_spec(plan, x, args.config.rsplit("/", 1)[-1].removesuffix(".yaml")).dump(
            args.ledger_spec)
    return 0 if plan.fits and not refused else 1


if __name__ == "__main__":
    sys.exit(main())
