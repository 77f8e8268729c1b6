"""docs/data-format.md against the real loader: every example row of the page goes through the
dataset loading of `megatron-gspo train` (`loop.build._dataset`: the file reader, the chat
template, the label check of the reward or environment, the agent's opening-prompt check) with
the config its `<!-- check: ... -->` marker names, and the one-line error the page quotes is
the line the command prints (`megatron-gspo: <Error>: <message>`); an example the page shows
as loading loads. The tool-call examples go through the real parser and calculator tool.

Run as a script (`python tests/data/test_data_format_page.py`) it prints what the loader says
for each example, to write the page from."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "data-format.md"
CONFIGS = {  # marker name -> (config, overrides)
    "tiny": ("examples/tiny/config.yaml", ["model.path=examples/tiny/base"]),
    "agent": ("examples/multiturn_agent/config_cpu.yaml",
              ["model.path=examples/multiturn_agent/base",
               "agent.environment=examples/multiturn_agent/env.py:ArithmeticAgentEnv"]),
}
BLOCK = re.compile(r"<!-- check: (\w+)((?: \S+)*) -->\s*```jsonl\n(.*?)```\s*```text\n(.*?)```",
                   re.S)


def examples(text: str) -> list[tuple[str, list[str], str, str]]:
    """(config name, overrides, the JSONL rows, the text block) of each checked example."""
    return [(m.group(1), m.group(2).split(), m.group(3), m.group(4).strip())
            for m in BLOCK.finditer(text)]


def what_the_loader_says(name: str, over: list[str], rows: str, workdir: Path) -> str:
    """The line `megatron-gspo train` prints for these rows as `data.train_path` (the file is
    `train.jsonl` in the working directory), or `loads: N rows` when they load."""
    from transformers import AutoTokenizer

    from megatron_gspo.cli import _input_errors
    from megatron_gspo.config import ConfigError, load_config
    from megatron_gspo.loop import build

    config, base = CONFIGS[name]
    (workdir / "train.jsonl").write_text(rows)
    cfg = load_config(str(ROOT / config), [
        re.sub(r"=(examples/)", lambda m: "=" + str(ROOT) + "/" + m.group(1), o)
        for o in base] + over)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    old = os.getcwd()
    os.chdir(workdir)
    try:
        ds = build._dataset(cfg, tok, "train.jsonl")
    except ConfigError as e:
        return f"megatron-gspo: config error: {e}"
    except _input_errors() as e:  # printed as one line by the CLI (cli/__init__.py)
        return f"megatron-gspo: {type(e).__name__}: {e}"
    finally:
        os.chdir(old)
    return f"loads: {len(ds)} rows"


def test_the_page_has_its_examples():
    found = examples(PAGE.read_text())
    assert len(found) >= 12
    assert {n for n, *_ in found} == set(CONFIGS)


def test_each_example_row_gets_what_the_page_says(tmp_path):
    wrong = []
    for name, over, rows, said in examples(PAGE.read_text()):
        got = what_the_loader_says(name, over, rows, tmp_path)
        want = said if said.startswith("megatron-gspo:") else said.splitlines()[0]
        if got != want:
            wrong.append((rows.strip()[-80:], want, got))
    assert not wrong, wrong


def test_tool_call_examples_parse_and_run():
    """The page's model turn with a tool call parses (hermes) to the call it shows, and the
    calculator answers it with the tool message the page shows; the page's tool schema is the
    calculator's."""
    from megatron_gspo.agent.chat import parse_action
    from megatron_gspo.agent.tools import build_toolset

    text = PAGE.read_text()
    turn = re.search(r"<!-- tool-turn -->\s*```text\n(.*?)```", text, re.S).group(1).rstrip("\n")
    result = json.loads(re.search(r"<!-- tool-result -->\s*```json\n(.*?)```", text,
                                  re.S).group(1))
    schema = json.loads(re.search(r"<!-- tool-schema -->\s*```json\n(.*?)```", text,
                                  re.S).group(1))
    tools = build_toolset()
    assert schema == tools.schemas()
    parsed = parse_action(turn)
    assert not parsed.errors and len(parsed.tool_calls) == 1
    out = asyncio.run(tools.execute(parsed.tool_calls[0]))
    assert out.error is None and {"role": "tool", "content": out.content} == result
    for m in re.finditer(r"<!-- tool-error: (\w+) -->\s*```text\n(.*?)```\s*```text\n(.*?)```",
                         text, re.S):
        kind, call, said = m.group(1), m.group(2).rstrip("\n"), m.group(3).strip()
        p = parse_action(call)
        if p.errors:
            assert kind == "invalid_call" and said == f"Error: {p.errors[0]}", (p.errors, said)
            continue
        res = asyncio.run(tools.execute(p.tool_calls[0]))
        assert (res.error, res.content) == (kind, said)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for name, over, rows, _ in examples(PAGE.read_text()):
            print(f"--- {name} {' '.join(over)}\n{rows.strip()[:120]}\n"
                  f"{what_the_loader_says(name, over, rows, Path(d))}")
    sys.exit(0)
