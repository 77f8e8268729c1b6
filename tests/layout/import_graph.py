"""The package's import graph, read from the source with `ast` (every import statement, at module
level or inside a function: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_gspo"


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module of the package."""
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that `name` (at `path`) imports."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import a.b.c` of a name inside a module
                t = t.rpartition(".")[0]
            if t.startswith("megatron_gspo") and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = module_names()
    return {n: imports_of(p, n, modules) for n, p in modules.items()}


# Rank of each unit (a top-level package, or a sub-package of rollout/): a unit imports only
# units of a lower rank. Same rank = siblings, which never import each other.
RANKS = {
    "megatron_gspo": 0,  # the package's __init__ (version only)
    "algo": 0, "data": 0, "config": 0, "runtime": 0,
    "quant": 0,  # block FP8 weights (pure torch) and the HF checkpoint converter built on it
    "convert": 1, "rollout": 1,  # rollout/'s top: engine interface, embedded engine, groups
    "rollout.delta": 1,  # the delta weight-sync codec, sender and the servers' loader (pure torch)
    "megatron": 2, "rewards": 2, "agent": 2, "rollout.sglang": 2, "rollout.asynchronous": 2,
    "rollout.standin": 3, "rollout.multinode": 3,
    "loop": 4, "study": 4,
    "cli": 5,
}
ROLLOUT_SUBPACKAGES = ("sglang", "standin", "asynchronous", "multinode", "delta")


def unit_of(module: str) -> str:
    """The unit a module belongs to: `megatron_gspo.rollout.sglang.client` -> `rollout.sglang`."""
    parts = module.split(".")
    if len(parts) == 1:
        return parts[0]
    if parts[1] == "rollout" and len(parts) > 2 and parts[2] in ROLLOUT_SUBPACKAGES:
        return f"rollout.{parts[2]}"
    return parts[1]


# Inside megatron/: the base modules at the top of the folder, then the sub-packages, then the
# learner's modules at the top (learner, learner_state, step, ...: every other top module). A
# sub-unit imports only lower ones; siblings never import each other.
MEGATRON_BASE = ("compat", "fallbacks", "cpu", "parallel")
MEGATRON_RANKS = {"base": 0, "models": 1, "lora": 2, "memory": 2, "moe": 2, "io": 3, "learner": 4}
MEGATRON_SUBPACKAGES = ("models", "lora", "memory", "moe", "io")


def megatron_unit(module: str) -> str | None:
    """The sub-unit of megatron/ a module belongs to (None outside megatron/):
    `megatron_gspo.megatron.io.weight_export` -> `io`, `...megatron.parallel` -> `base`,
    `...megatron.learner` -> `learner`."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "megatron":
        return None
    if parts[2] in MEGATRON_SUBPACKAGES:
        return parts[2]
    return "base" if parts[2] in MEGATRON_BASE else "learner"


def megatron_upward_imports(g: dict[str, set[str]],
                            ranks: dict[str, int] = MEGATRON_RANKS) -> list[str]:
    """Every import inside megatron/ of a sub-unit of the same or a higher rank."""
    bad = []
    for src, dsts in g.items():
        us = megatron_unit(src)
        for dst in sorted(dsts):
            ud = megatron_unit(dst)
            if us is None or ud is None or ud == us:
                continue
            if ranks[ud] >= ranks[us]:
                bad.append(f"{src} ({us}, rank {ranks[us]}) -> {dst} ({ud}, rank {ranks[ud]})")
    return bad


def package_units(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with every sub-package of a top-level package collapsed to one node
    (`megatron_gspo.megatron.io.weight_export` -> `megatron_gspo.megatron.io`; a plain module such
    as
    `megatron_gspo.megatron.learner` stays itself): its circles are circles between
    sub-packages, which the module graph can miss (a -> b.x, b.y -> a.z)."""
    def unit(m: str) -> str:
        return ".".join(m.split(".")[:3])
    out: dict[str, set[str]] = {}
    for src, dsts in g.items():
        out.setdefault(unit(src), set()).update(unit(d) for d in dsts if unit(d) != unit(src))
    return out


def upward_imports(g: dict[str, set[str]], ranks: dict[str, int] = RANKS) -> list[str]:
    """Every import of a unit of the same or a higher rank (or of a unit with no rank)."""
    bad = []
    for src, dsts in g.items():
        us = unit_of(src)
        for dst in sorted(dsts):
            ud = unit_of(dst)
            if ud == us:
                continue
            if us not in ranks or ud not in ranks:
                bad.append(f"{src} -> {dst}: unit {us if us not in ranks else ud} has no rank")
            elif ranks[ud] >= ranks[us]:
                bad.append(f"{src} ({us}, rank {ranks[us]}) -> {dst} ({ud}, rank {ranks[ud]})")
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def external_imports(path: Path) -> set[str]:
    """Top-level names of the modules outside the package that a file imports."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return {n for n in names if not n.startswith("megatron_gspo")}
