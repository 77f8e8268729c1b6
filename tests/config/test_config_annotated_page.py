"""docs/config-annotated.md: its YAML block loads with the trainer's strict config loader (an
unknown key or a wrong type is an error), holds every field of the config dataclasses (none
missing, none extra), each under its section with a comment line of its own just above it, at
its default value (the page says the block is the defaults)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from megatron_gspo.config import Config, describe, load_config

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "config-annotated.md"


def _block() -> str:
    m = re.search(r"<!-- full-config -->\s*```yaml\n(.*?)```", PAGE.read_text(), re.S)
    assert m, "no ```yaml block after <!-- full-config --> in docs/config-annotated.md"
    return m.group(1)


def _leaves(d: dict, prefix: str = "") -> list[str]:
    """Dotted field names of the YAML mapping (a dict-valued field such as reward.kwargs is a
    leaf: its keys are the user's)."""
    names = {r[0] for r in describe(Config)}
    out = []
    for k, v in d.items():
        name = f"{prefix}{k}"
        out += _leaves(v, name + ".") if isinstance(v, dict) and name not in names else [name]
    return out


def test_the_block_loads_with_the_strict_loader_at_the_defaults(tmp_path):
    path = tmp_path / "full.yaml"
    path.write_text(_block())
    assert load_config(str(path), []) == Config()


def test_the_block_holds_every_field_once():
    data = yaml.safe_load(_block())
    fields = [r[0] for r in describe(Config)]
    leaves = _leaves(data)
    assert len(leaves) == len(set(leaves))
    assert sorted(set(fields) - set(leaves)) == [], "fields the page lacks"
    assert sorted(set(leaves) - set(fields)) == [], "keys that are no field"
    assert list(data) == [f.name for f in dataclasses.fields(Config)]  # sections in order


def test_every_field_and_section_has_its_comment():
    lines = _block().splitlines()
    bare = []
    for i, line in enumerate(lines):
        m = re.match(r"( *)(\w+):( .*)?$", line)
        if not m:
            continue
        nested = m.group(3) is None and i + 1 < len(lines) and \
            lines[i + 1].startswith(m.group(1) + "  ")
        if nested and m.group(1):  # a subsection (model.lora): its fields carry the comments
            continue
        if not (i and lines[i - 1].strip().startswith("#")):
            bare.append(line.strip())
    assert bare == [], f"fields or sections without a comment: {bare}"
