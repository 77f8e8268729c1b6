"""The GPU kit carries every package the GPU check stages import that the GPU check machine
lacks (scripts/gpu_machine_packages.txt, dated): the modules each stage imports are recorded
from the stages themselves (a dry run with GPU_CHECKS_RECORD_IMPORTS, in a venv holding only
the machine's packages plus the kit's), and the kit check imports all of them
(scripts/gpu_stage_imports.txt)."""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_kit  # noqa: E402
import gpu_machine_venv  # noqa: E402

sys.path.pop(0)
from tests.gpu.test_gpu_checks_dry_run import STAGES, fake_wheel, run_checks  # noqa: E402


def machine() -> set[str]:
    return gpu_machine_venv.names_of(gpu_machine_venv.MACHINE)


def kit() -> set[str]:
    return gpu_machine_venv.names_of(gpu_machine_venv.KIT)


def test_machine_list_is_one_dated_file():
    text = gpu_machine_venv.MACHINE.read_text()
    assert re.search(r"^# date: \d{4}-\d{2}-\d{2}$", text, re.MULTILINE)
    assert {"torch", "triton", "transformers", "safetensors", "numpy", "pyyaml"} <= machine()
    assert not machine() & kit(), "a kit pin the machine already has"


def test_every_stage_import_is_on_the_machine_or_in_the_kit():
    """Counting, as the machine's, the requirements of the machine's distributions as installed
    here (this interpreter's newer huggingface-hub needs httpx2 where the machine's needs
    httpx): those come with the machine's own versions."""
    dists = md.packages_distributions()
    here = {gpu_machine_venv.norm(d.metadata["Name"]): d for d in md.distributions()}
    have = gpu_machine_venv.closure(machine(), here) | kit()
    stages = gpu_kit.read_stage_imports()
    assert set(stages) == set(STAGES) - {"wheels"}  # the wheels stage imports all of them
    lacking = {}
    for stage, mods in stages.items():
        for m in mods:
            names = {gpu_machine_venv.norm(d) for d in dists.get(m, [])}
            if names and not names & have:
                lacking.setdefault(stage, []).append(f"{m} ({', '.join(sorted(names))})")
    assert lacking == {}, f"stage imports neither on the GPU machine nor in the kit: {lacking}"
    assert {"math_verify", "latex2sympy2_extended", "antlr4"} <= set(stages["demo"])


def test_kit_requirements_are_on_the_machine_or_in_the_kit():
    """The kit installs with --no-deps: what its wheels need must already be there."""
    for name in kit():
        need = gpu_machine_venv.requirement_names(md.distribution(name))
        assert need <= machine() | kit(), f"{name} needs {sorted(need - machine() - kit())}"


@pytest.mark.slow
def test_dry_run_in_the_gpu_machines_package_set(tmp_path):
    """Every stage with tiny sizes on the CPU, in a venv of only the machine's packages plus
    the kit's (a kit of stand-in wheels: no download); the modules each stage imported are
    among those the kit check imports."""
    venv = tmp_path / "venv"
    linked, _ = gpu_machine_venv.build(venv)
    assert kit() <= set(linked)
    box = tmp_path / "kit"
    for name, version in gpu_kit.read_manifest().items():
        fake_wheel(box, name=name, version=version)
    out, rec = tmp_path / "out", tmp_path / "imports"
    r = run_checks("--cpu-dry-run", "--kit", str(box), str(out), timeout=900,
                   env={"PYTHON": str(venv / "bin" / "python"),
                        "GPU_CHECKS_RECORD_IMPORTS": str(rec), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    summary = (out / "summary.md").read_text()
    assert "Every stage passed." in summary, r.stdout[-4000:]
    rows = [ln for ln in summary.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert len(rows) == 1 + len(STAGES) and all(" | ok | " in row for row in rows[1:])
    assert "2 steps, reward/mean" in summary and "tiny-qwen3 float32 local spec" in summary
    assert sorted(p.name for p in out.iterdir()) == ["checks.log", "metrics.jsonl",
                                                     "results.json", "summary.md"]
    got, listed = gpu_kit.recorded_imports(rec), gpu_kit.read_stage_imports()
    assert set(got) == set(STAGES) - {"wheels"}
    new = {s: sorted(set(m) - set(listed.get(s, []))) for s, m in got.items()}
    assert not any(new.values()), (
        f"stages import modules the kit check does not: {new}; run the dry run with "
        "GPU_CHECKS_RECORD_IMPORTS=DIR and `scripts/gpu_kit.py imports --recorded DIR --write`")
