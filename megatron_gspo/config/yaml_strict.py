"""A strict YAML reader for configs: PyYAML's safe loader minus the YAML 1.1 surprises.

Refused, each with a one-line error naming the line:
- a key written twice in one mapping (PyYAML keeps the last one silently);
- integers with a leading zero such as `010` (YAML 1.1 reads them as octal: 8) and
  sexagesimal numbers such as `1:30` (read as 90); write `10`, `0o10` or quote the text.
"""

from __future__ import annotations

import re

import yaml

__all__ = ["StrictYAMLError", "strict_load"]

_OCTAL = re.compile(r"^[-+]?0[0-9_]+$")
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")


class StrictYAMLError(ValueError):
    """A YAML document the strict loader refuses (message: one line)."""


def _line(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1}"


class _StrictLoader(yaml.SafeLoader):
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
                    raise StrictYAMLError(f"{_line(key_node)}: duplicate key {key!r} (first at "
                                          f"{seen[key]})")
                seen[key] = _line(key_node)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = str(node.value)
        if _OCTAL.match(text) and text.lstrip("+-").strip("0_") != "":
            raise StrictYAMLError(f"{_line(node)}: {text!r} has a leading zero (YAML 1.1 reads "
                                  "it as an octal number); write it without the zero, as 0o..., "
                                  "or quote it")
        if _SEXAGESIMAL.match(text):
            raise StrictYAMLError(f"{_line(node)}: {text!r} is a base-60 number in YAML 1.1; "
                                  "quote it")
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        text = str(node.value)
        if _SEXAGESIMAL.match(text):
            raise StrictYAMLError(f"{_line(node)}: {text!r} is a base-60 number in YAML 1.1; "
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
        StrictYAMLError: duplicate key, leading-zero or base-60 number.
        yaml.YAMLError: malformed YAML.
    """
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
