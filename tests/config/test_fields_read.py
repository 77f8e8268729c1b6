"""Every documented config field is read by the code that runs (an unread field is a promise
the software does not keep: setting it changes nothing).

The check is static, over the package's syntax trees: a field `section.name` counts as read
when some module of megatron_gspo loads an attribute `.name` (or `getattr(x, "name")`) outside
the config's own validation (`Config.validate`, `__post_init__`), which checks values but does
not act on them. Attribute names are matched without their object (aliases such as
`r = cfg.rollout` are everywhere), so a field whose name some other object also carries can
pass unread; a field no code reads at all -- what this test is for -- never passes. A dynamic
check (recording attribute reads during runs) would need a run through every optional path
(SGLang, agents, MoE, asynchronous rollouts, KL) to see each field once; the static one sees all
code paths at once and runs in a second."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megatron_gspo.config import Config

PKG = Path(__file__).resolve().parents[2] / "megatron_gspo"
NOT_ACTING = ("validate", "__post_init__")  # functions that check values, not use them


def documented_fields() -> list[tuple[str, str]]:
    out = []
    for sec in dataclasses.fields(Config):
        for f in dataclasses.fields(sec.default_factory()):
            if f.metadata.get("doc") or f.metadata:
                out.append((sec.name, f.name))
    return out


def read_names() -> set[str]:
    names: set[str] = set()
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        skip: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in NOT_ACTING:
                skip.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "getattr" and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant)):
                names.add(str(node.args[1].value))
    return names


def test_every_documented_field_is_read():
    fields = documented_fields()
    assert len(fields) > 100  # the walk found the sections
    names = read_names()
    unread = [f"{s}.{n}" for s, n in fields if n not in names]
    assert unread == [], f"documented config fields nothing reads: {unread}"
