"""The package layout: no import circle, no import of a higher layer (cli -> loop, study ->
rollout, agent, rewards, megatron -> convert -> algo, data, config, run), Megatron-Core only under
megatron/, algo/ pure torch, and no file over 450 lines. The checks are also run on small
made-up graphs, so that a circle or an upward import is seen to fail them."""

from __future__ import annotations

import pytest

from tests.layout.import_graph import (
    PKG,
    RANKS,
    cycles,
    external_imports,
    graph,
    unit_of,
    upward_imports,
)

@pytest.fixture(scope="module")
def g():
    return graph()


def test_no_import_circle(g):
    assert cycles(g) == []


def test_no_upward_import(g):
    assert upward_imports(g) == []


def test_every_unit_has_a_rank(g):
    assert sorted({unit_of(m) for m in g} - set(RANKS)) == []


def test_checks_catch_a_circle_and_an_upward_import():
    circle = {"megatron_gspo.loop.build": {"megatron_gspo.agent.loop"},
              "megatron_gspo.agent.loop": {"megatron_gspo.loop.build"}}
    assert cycles(circle) == [["megatron_gspo.agent.loop", "megatron_gspo.loop.build"]]
    bad = upward_imports(circle)
    assert len(bad) == 1 and bad[0].startswith("megatron_gspo.agent.loop (agent, rank 2)")
    sibling = {"megatron_gspo.rollout.sglang.client": {"megatron_gspo.agent.runner"},
               "megatron_gspo.agent.runner": set()}
    assert len(upward_imports(sibling)) == 1  # same rank: siblings never import each other
    assert upward_imports({"megatron_gspo.newpkg.x": {"megatron_gspo.algo.losses"}})
    chain = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(chain) == [["a", "b", "c"]]


def test_megatron_core_only_under_megatron():
    bad = []
    for p in PKG.rglob("*.py"):
        inside = p.relative_to(PKG).parts[0] == "megatron"
        if not inside and any(n == "megatron" or n.startswith("megatron.")
                              for n in external_imports(p)):
            bad.append(str(p.relative_to(PKG)))
    assert bad == []


def test_algo_is_pure_torch():
    allowed = {"torch", "math", "dataclasses", "typing", "collections", "__future__", "numbers",
               "functools", "enum", "abc", "itertools", "warnings", "numpy"}
    bad = {str(p.relative_to(PKG)): sorted(n for n in external_imports(p)
                                          if n.split(".")[0] not in allowed)
           for p in (PKG / "algo").rglob("*.py")}
    assert {k: v for k, v in bad.items() if v} == {}
    algo_deps = {d for m, ds in graph().items() if unit_of(m) == "algo" for d in ds}
    assert {unit_of(d) for d in algo_deps} <= {"algo"}


def test_no_package_module_imports_an_old_path(g):
    old = {"megatron_gspo.rollout.standin_server", "megatron_gspo.rollout.standin_router"}
    assert [m for m, ds in g.items() if ds & old] == []



MAX_LINES = 450


def test_no_file_over_the_limit():
    root = PKG.parent
    files = [p for d in ("megatron_gspo", "tools", "scripts", "bench", "examples")
             for p in (root / d).rglob("*.py")]
    long = {str(p.relative_to(root)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
