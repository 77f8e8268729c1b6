"""The reference pages of the documentation site, generated from the code they describe: every
config field (`config.describe`, the same rows as `megatron-gspo fields`), every metric a run
logs (`loop/metric_keys.py`) and every command's `--help`. `docs/hooks.py` adds them to the
site at build time, so they cannot drift; `megatron-gspo fields --markdown` prints the first."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
from contextlib import redirect_stdout


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def config_reference() -> str:
    """Markdown: one table per config section, a row per field (name, type, default, doc)."""
    from megatron_gspo.config import Config, describe

    out = ["# Configuration reference", "",
           "Every field of a run config, generated from the config dataclasses "
           "(`megatron_gspo/config/sections.py`; the same list as `megatron-gspo fields`). "
           "Set a field in the YAML file or override it as `section.field=value` "
           "([Configuration](../configuration.md)).", ""]
    rows = describe(Config)
    for section in (f.name for f in dataclasses.fields(Config)):
        out += [f"## {section}", "", "| field | type | default | meaning |", "|---|---|---|---|"]
        for name, tp, default, doc in rows:
            if name.split(".")[0] == section:
                out.append(f"| `{name}` | {_cell(tp)} | `{_cell(repr(default))}` | {_cell(doc)} |")
        out.append("")
    return "\n".join(out)


def metrics_reference() -> str:
    """Markdown: one table per metric family of `loop/metric_keys.py` (key, unit, meaning)."""
    from megatron_gspo.loop.metric_keys import GROUPS

    out = ["# Metrics reference", "",
           "Every key a training run writes to `RUN_DIR/metrics.jsonl` (one JSON object per "
           "step; the same keys go to tensorboard and Weights & Biases), generated from "
           "`megatron_gspo/loop/metric_keys.py`. A test runs tiny CPU runs (synchronous with "
           "evaluation and the audit, KL and corrections, asynchronous, agent, MoE) and fails "
           "on a key this page lacks.", "",
           "In a key, `<name>` stands for one path segment, `<name...>` for one or more, and "
           "`[...]` for an optional part: `eval/[<set>/]mean@<n>` is `eval/mean@4` for "
           "`data.eval_path` and `eval/gsm8k/mean@4` for an eval set named gsm8k. "
           "`python tools/plot_metrics.py RUN_DIR` plots them.", ""]
    for g in GROUPS:
        out += [f"## {g.title}", "", f"Logged: {g.when}.", "",
                "| key | unit | meaning |", "|---|---|---|"]
        out += [f"| `{_cell(k)}` | {_cell(u)} | {_cell(m)} |" for k, u, m in g.rows]
        out.append("")
    return "\n".join(out)


def _help(parser: argparse.ArgumentParser) -> str:
    """The parser's help at a fixed width of 100 columns (argparse reads $COLUMNS)."""
    buf = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with redirect_stdout(buf):
            parser.print_help()
    finally:
        if old is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = old
    return buf.getvalue().rstrip()


def cli_reference(p: argparse.ArgumentParser, conv: argparse.ArgumentParser) -> str:
    """Markdown: `megatron-gspo --help` (`p`), each subcommand's, and the conversion commands'
    (`conv`, the parser of `megatron-gspo convert`)."""
    out = ["# Command-line reference", "",
           "Generated from the commands' own `--help`.", "", "```text", _help(p), "```", ""]
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        if name == "convert":
            continue
        out += [f"## megatron-gspo {name}", "", "```text", _help(sp), "```", ""]
    out += ["## megatron-gspo convert", "",
            "The same commands as `python tools/convert_checkpoint.py` "
            "([Conversion](../conversion.md)).",
            "", "```text", _help(conv), "```", ""]
    csub = next(a for a in conv._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in csub.choices.items():
        out += [f"### {name}", "", "```text", _help(sp), "```", ""]
    return "\n".join(out)
