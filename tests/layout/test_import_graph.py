"""The package layout: no import circle, no import of a higher layer (cli -> loop, study ->
rollout, agent, rewards, megatron -> convert -> algo, data, config, run), Megatron-Core only under
megatron/, algo/ pure torch, and no file over 450 lines. The checks are also run on small
made-up graphs, so that a circle or an upward import is seen to fail them."""

from __future__ import annotations

import pytest

from tests.layout.import_graph import (
    MEGATRON_BASE,
    MEGATRON_SUBPACKAGES,
    PKG,
    RANKS,
    cycles,
    external_imports,
    graph,
    megatron_unit,
    megatron_upward_imports,
    package_units,
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


def test_no_circle_between_sub_packages(g):
    assert cycles(package_units(g)) == []


def test_megatron_sub_packages_import_only_lower_ones(g):
    assert megatron_upward_imports(g) == []
    top = {p.stem for p in (PKG / "megatron").glob("*.py")} - {"__init__", "__main__"}
    assert set(MEGATRON_BASE) <= top
    assert {p.name for p in (PKG / "megatron").iterdir()
            if (p / "__init__.py").is_file()} == set(MEGATRON_SUBPACKAGES)


def test_sub_package_checks_catch_a_circle_and_an_upward_import():
    # two modules with no module-level circle, whose sub-packages import each other
    g = {"megatron_gspo.megatron.io.weight_export": {"megatron_gspo.megatron.lora.adapters"},
         "megatron_gspo.megatron.lora.adapters": {"megatron_gspo.megatron.io.weights"},
         "megatron_gspo.megatron.io.weights": set()}
    assert cycles(g) == []
    assert cycles(package_units(g)) == [["megatron_gspo.megatron.io",
                                         "megatron_gspo.megatron.lora"]]
    assert len(megatron_upward_imports(g)) == 1  # lora (rank 2) -> io (rank 3)
    assert megatron_unit("megatron_gspo.megatron.parallel") == "base"
    assert megatron_unit("megatron_gspo.megatron.learner") == "learner"
    assert megatron_unit("megatron_gspo.loop.train") is None
    up = {"megatron_gspo.megatron.compat": {"megatron_gspo.megatron.models.builder"}}
    assert megatron_upward_imports(up)  # a base module importing a sub-package


def test_old_paths_name_the_new_ones():
    """Every moved module, through the one table of the package's __init__."""
    import importlib

    from megatron_gspo import MOVED
    assert len(MOVED) >= 48
    for old, new in MOVED.items():
        with pytest.raises(ImportError, match=f"{old} moved to {new}"):
            importlib.import_module(old)
        rel = new.split(".", 1)[1].replace(".", "/")
        assert (PKG / (rel + ".py")).is_file() or (PKG / rel / "__init__.py").is_file(), new
        assert not (PKG / (old.split(".", 1)[1].replace(".", "/") + ".py")).exists(), old
    with pytest.raises(ImportError, match="run.checkpoint is runtime.run_checkpoint"):
        importlib.import_module("megatron_gspo.run.checkpoint")
    with pytest.raises(ImportError, match="moved to megatron_gspo.megatron.lora.adapters"):
        from megatron_gspo.megatron.lora import LoraSettings  # noqa: F401


def test_no_two_modules_share_a_file_name():
    """A family's pair (convert/X.py beside megatron/models/X.py) aside; so that `ls` and a
    traceback name one place (weight sync, checkpointing and servers once had two or three)."""
    by_name: dict[str, list[str]] = {}
    for p in PKG.rglob("*.py"):
        if p.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(p.name, []).append(str(p.parent.relative_to(PKG)))
    dup = {n: sorted(ds) for n, ds in by_name.items() if len(ds) > 1}
    pairs = {n for n, ds in dup.items() if sorted(ds) == ["convert", "megatron/models"]}
    assert {n: ds for n, ds in dup.items() if n not in pairs} == {}


def test_weight_sync_and_checkpointing_are_found_by_name():
    """A newcomer's `ls`: every module of the weight-sync path and of checkpointing says so."""
    names = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py")}
    sync = {n for n in names if "weight_sync" in n or "weight_export" in n}
    assert {"loop/weight_sync_phase.py", "rollout/weight_sync_payloads.py",
            "rollout/sglang/weight_sync_endpoints.py", "rollout/sglang/weight_sync_delta.py",
            "rollout/multinode/weight_sync_nodes.py", "rollout/standin/weight_sync_server.py",
            "megatron/io/weight_export.py"} <= sync
    assert {n for n in names if "checkpoint" in n} >= {"runtime/run_checkpoint.py",
                                                       "megatron/io/dist_checkpoint.py"}
    layout = (PKG.parent / "docs" / "layout.md").read_text()
    assert all(f"`{n}`" in layout or n in layout for n in sync)


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
    from megatron_gspo import MOVED
    assert [m for m, ds in g.items() if ds & set(MOVED)] == []


MAX_LINES = 450


def test_no_file_over_the_limit():
    root = PKG.parent
    files = [p for d in ("megatron_gspo", "tools", "scripts", "bench", "examples")
             for p in (root / d).rglob("*.py")]
    long = {str(p.relative_to(root)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
