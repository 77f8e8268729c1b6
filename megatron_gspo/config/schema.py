"""Typed-dataclass config machinery: YAML in, strict checking, `a.b=c` overrides, YAML out.

Every field is declared with `option(default, doc, ...)`: a one-line doc plus optional
`choices` and numeric bounds. Loading walks the dataclasses recursively; an unknown key, a wrong
type or an out-of-range value raises `ConfigError` naming the dotted path, e.g.
`algorithm.eps_high: expected float > 0, got 'x'`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any

import yaml

from megatron_gspo.config.yaml_strict import StrictYAMLError, brief, strict_load

_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

__all__ = ["ConfigError", "option", "from_dict", "to_dict", "apply_overrides", "describe"]


class ConfigError(ValueError):
    """A configuration value that is unknown, mistyped or out of range (names its path)."""


def option(default=dataclasses.MISSING, doc: str = "", *, choices=None, ge=None, gt=None,
           le=None, lt=None, default_factory=dataclasses.MISSING):
    """Declare a config field with its one-line doc and constraints."""
    meta = {"doc": doc, "choices": tuple(choices) if choices else None,
            "ge": ge, "gt": gt, "le": le, "lt": lt}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _bounds_text(meta) -> str:
    parts = []
    for key, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if meta.get(key) is not None:
            parts.append(f"{sym} {meta[key]}")
    return " and ".join(parts)


def _key(key) -> str:
    """A mapping key as a message shows it: plain when short and printable, else brief()."""
    return key if isinstance(key, str) and key.isprintable() and len(key) <= 80 else brief(key)


def _coerce(value, tp, path: str, meta: dict):
    """Check/convert one value against a type annotation; raise ConfigError naming `path`."""
    def fail(expect: str):
        raise ConfigError(f"{path}: expected {expect}, got {brief(value)}")

    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path, meta)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        fail(_type_name(tp))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            fail(f"a mapping for section {tp.__name__}")
        return from_dict(tp, value, path)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            fail(_type_name(tp))
        return [_coerce(v, item, f"{path}[{i}]", {}) for i, v in enumerate(value)]
    if origin is dict:
        kt, vt = typing.get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            fail(_type_name(tp))
        return {_coerce(k, kt, path, {}): _coerce(v, vt, f"{path}.{_key(k)}", {})
                for k, v in value.items()}
    bounds = _bounds_text(meta)
    expect = _type_name(tp) + (f" {bounds}" if bounds else "")
    if tp is bool:
        if not isinstance(value, bool):
            fail("bool (true/false)")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(expect)
    elif tp is float:
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            value = float(value)  # YAML 1.1 reads `5e-4` (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(expect)
        value = float(value)
        if not math.isfinite(value):  # NaN / inf never make a meaningful setting
            fail(f"a finite {expect}")
    elif tp is str:
        if isinstance(value, bool) and {"on", "off"} <= set(meta.get("choices") or ()):
            value = "on" if value else "off"  # YAML 1.1 reads on/off as booleans
        if not isinstance(value, str):
            fail("str")
    if meta.get("choices") and value not in meta["choices"]:
        fail("one of " + ", ".join(repr(c) for c in meta["choices"]))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, ok in (("gt", lambda a, b: a > b), ("ge", lambda a, b: a >= b),
                        ("lt", lambda a, b: a < b), ("le", lambda a, b: a <= b)):
            if meta.get(key) is not None and not ok(value, meta[key]):
                fail(expect)
    return value


def from_dict(cls, data: dict | None, path: str = ""):
    """Build dataclass `cls` from a plain mapping, strictly.

    Args:
        cls: a dataclass type whose fields were declared with `option`.
        data: mapping (None = all defaults).
        path: dotted prefix used in error messages.
    Returns:
        an instance of `cls`.
    """
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<root>'}: expected a mapping, got {brief(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{path}.{_key(key)}" if path else _key(key)
            close = [f for f in fields if f.startswith(str(key)[:3])]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"{where}: unknown key{hint}; known keys: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], sub, dict(f.metadata))
        elif dataclasses.is_dataclass(hints[name]):
            kwargs[name] = from_dict(hints[name], {}, sub)
    return cls(**kwargs)


def to_dict(obj) -> dict:
    """Plain nested dict of a config dataclass (YAML-serialisable)."""
    return dataclasses.asdict(obj)


def _parse_override(text: str):
    if "=" not in text:
        raise ConfigError(f"override {brief(text)}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {brief(text)}: empty key")
    try:
        value = strict_load(raw) if raw.strip() != "" else ""
    except StrictYAMLError as e:
        raise ConfigError(f"override {_key(key)}: {str(e).split(': ', 1)[-1]}") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"override {_key(key)}: cannot parse value {brief(raw)}: "
                          f"{first}") from None
    return key.split("."), value


def apply_overrides(cls, data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=c` overrides (values parsed as YAML) onto a raw mapping.

    The key path is checked against the schema of `cls` so a typo fails with its path.
    """
    data = dict(data or {})
    for text in overrides:
        parts, value = _parse_override(text)
        tp, node = cls, data
        for i, part in enumerate(parts):
            where = _key(".".join(parts[: i + 1]))
            if not dataclasses.is_dataclass(tp):
                raise ConfigError(f"{where}: {_key('.'.join(parts[:i]))} is not a section")
            names = {f.name for f in dataclasses.fields(tp)}
            if part not in names:
                raise ConfigError(f"{where}: unknown key; known keys: {', '.join(sorted(names))}")
            tp = typing.get_type_hints(tp)[part]
            if i == len(parts) - 1:
                node[part] = value
            else:
                child = node.get(part)
                node[part] = dict(child) if isinstance(child, dict) else {}
                node = node[part]
    return data


def describe(cls, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted name, type, default, doc) for every field, for docs and `--help`."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, name + "."))
            continue
        default = (f.default if f.default is not dataclasses.MISSING
                   else f.default_factory() if f.default_factory is not dataclasses.MISSING
                   else None)
        rows.append((name, _type_name(tp), default, f.metadata.get("doc", "")))
    return rows
