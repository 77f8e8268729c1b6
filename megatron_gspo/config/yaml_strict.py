"""A strict YAML reader for configs: PyYAML's safe loader minus the YAML 1.1 surprises.

Refused, each with a one-line error naming the line:
- a key written twice in one mapping (PyYAML keeps the last one silently);
- integers with a leading zero such as `010` (YAML 1.1 reads them as octal: 8) and
  sexagesimal numbers such as `1:30` (read as 90); write `10`, `0o10` or quote the text;
- aliases that expand the document by more than `MAX_ALIAS_NODES` nodes (an "alias bomb": a
  0.5 KB file of nine nested anchors stands for 10^9 values) and a value that contains itself.

`brief(value)` is the bounded repr every config error message uses for a value.
"""

from __future__ import annotations

import re
import reprlib

import yaml

__all__ = ["MAX_ALIAS_NODES", "StrictYAMLError", "brief", "strict_load"]

MAX_ALIAS_NODES = 100_000  # nodes aliases may add; a hand-written config adds a few hundred
_BRIEF_CHARS = 160
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = _BRIEF_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8
_REPR.maxlevel = 3

_OCTAL = re.compile(r"^[-+]?0[0-9_]+$")
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")


class StrictYAMLError(ValueError):
    """A YAML document the strict loader refuses (message: one line)."""


def brief(value) -> str:
    """A repr of `value` of at most ~160 characters, on one line, in time bounded by the
    text shown (never a walk of a whole nested value).

    Args:
        value: anything.
    Returns:
        the repr, shortened with '...' where it would be longer.
    """
    text = _REPR.repr(value)
    return text if len(text) <= _BRIEF_CHARS else text[: _BRIEF_CHARS - 3] + "..."


def _line(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1}"


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_aliases(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand it by more than MAX_ALIAS_NODES nodes, or that
    contains itself; names the line of the deepest value that expands too far."""
    size: dict[int, int] = {}  # id(node) -> nodes of its expansion, memoized: linear time
    busy: set[int] = set()

    def expand(node: yaml.Node) -> int:
        key = id(node)
        if key in size:
            return size[key]
        if key in busy:
            raise StrictYAMLError(f"{_line(node)}: a value that contains itself through an "
                                  "alias (recursive anchor); a config has no use for one")
        busy.add(key)
        size[key] = 1 + sum(expand(c) for c in _children(node))
        busy.discard(key)
        return size[key]

    total = expand(root)
    if total - len(size) <= MAX_ALIAS_NODES:
        return
    node = root
    while True:  # down to the deepest value that alone is past the bound
        big = [c for c in _children(node) if size[id(c)] > MAX_ALIAS_NODES]
        if not big:
            break
        node = max(big, key=lambda c: size[id(c)])
    raise StrictYAMLError(f"{_line(node)}: aliases expand this value to {size[id(node)]} nodes "
                          f"(more than {MAX_ALIAS_NODES}; a YAML alias bomb?); write the "
                          "values out or use fewer nested aliases")


class _StrictLoader(yaml.SafeLoader):
    def construct_document(self, node):
        _check_aliases(node)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # PyYAML reports unhashable keys itself
                if key in seen:
                    raise StrictYAMLError(f"{_line(key_node)}: duplicate key {brief(key)} "
                                          f"(first at {seen[key]})")
                seen[key] = _line(key_node)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = str(node.value)
        if _OCTAL.match(text) and text.lstrip("+-").strip("0_") != "":
            raise StrictYAMLError(f"{_line(node)}: {brief(text)} has a leading zero (YAML 1.1 "
                                  "reads it as an octal number); write it without the zero, as "
                                  "0o..., or quote it")
        if _SEXAGESIMAL.match(text):
            raise StrictYAMLError(f"{_line(node)}: {brief(text)} is a base-60 number in YAML 1.1; "
                                  "quote it")
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        text = str(node.value)
        if _SEXAGESIMAL.match(text):
            raise StrictYAMLError(f"{_line(node)}: {brief(text)} is a base-60 number in YAML 1.1; "
                                  "quote it")
        return super().construct_yaml_float(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_yaml_float)


def strict_load(text: str):
    """Parse one YAML document like `yaml.safe_load`, refusing duplicate keys and ambiguous
    YAML 1.1 numbers.

    Args:
        text: the YAML text.
    Returns:
        the parsed object.
    Raises:
        StrictYAMLError: duplicate key, leading-zero or base-60 number, alias bomb.
        yaml.YAMLError: malformed YAML.
    """
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
