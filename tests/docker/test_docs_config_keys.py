"""Every `section.key` the multi-node docs and launch scripts mention is a real config field."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megatron_gspo.config import Config

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "docs" / "multinode.md", ROOT / "docker" / "README.md",
         *sorted((ROOT / "docker" / "launch").iterdir())]


def test_documented_keys_exist():
    sections = {f.name: {g.name for g in dataclasses.fields(f.default_factory())}
                for f in dataclasses.fields(Config)}
    pattern = re.compile(rf"\b({'|'.join(sections)})\.([a-z_]+)\b")
    seen, unknown = set(), []
    for path in FILES:
        for section, key in pattern.findall(path.read_text()):
            seen.add(f"{section}.{key}")
            if key not in sections[section]:
                unknown.append(f"{path.relative_to(ROOT)}: {section}.{key}")
    assert not unknown, f"not config fields: {unknown}"
    assert {"parallel.expert", "rollout.mem_fraction", "checkpoint.dir"} <= seen
