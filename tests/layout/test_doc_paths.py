"""Paths into the package named by the docs, scripts, configs and comments exist (they followed
the package when it moved), and the module paths users type still work: the console script's
entry point, `python -m megatron_gspo.cli`, and the stand-in server's old `-m` path."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNITS = "agent|algo|cli|config|convert|data|loop|megatron|rewards|rollout|run|study"
PATH_RE = re.compile(rf"(?<![\w/.-])(?:megatron_gspo/)?(?:{UNITS})/[A-Za-z0-9_/]+\.py\b")
UPSTREAM = ("megatron/core/",)  # Megatron-Core's own files, named in comments


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    return [ROOT / f for f in out.split() if f.endswith((".md", ".py", ".sh", ".yaml", ".toml"))
            and not f.startswith("tests/")]


def test_package_paths_in_docs_and_code_exist():
    missing = set()
    for f in _tracked():
        for m in PATH_RE.finditer(f.read_text(errors="replace")):
            p = m.group(0)
            if p.startswith(UPSTREAM):
                continue
            q = p if p.startswith("megatron_gspo/") else f"megatron_gspo/{p}"
            if not (ROOT / q).is_file():
                missing.add(f"{f.relative_to(ROOT)}: {p}")
    assert sorted(missing) == []


def test_path_check_sees_a_stale_path(tmp_path):
    assert PATH_RE.findall("see rollout/sglang_launch.py and tests/rollout/x.py") == [
        "rollout/sglang_launch.py"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_typed_module_paths_work():
    r = _run("-m", "megatron_gspo.cli", "--version")
    assert r.returncode == 0, r.stderr
    r = _run("-m", "megatron_gspo.rollout.standin.server", "--help")
    assert r.returncode == 0 and "--model-path" in r.stdout, r.stderr
    r = _run("-m", "megatron_gspo.rollout.standin_server", "--help")  # an old command line
    assert r.returncode != 0
    assert ("moved to megatron_gspo.rollout.standin.server: import that instead"
            in r.stderr.strip().splitlines()[-1]), r.stderr
    r = _run("-c", "import megatron_gspo.rollout.standin_router")
    assert r.returncode != 0
    assert "moved to megatron_gspo.rollout.standin.router" in r.stderr.strip().splitlines()[-1]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'megatron-gspo = "megatron_gspo.cli:main"' in pyproject
    r = _run("-c", "from megatron_gspo.cli import main; import sys; sys.exit(main(['--version']))")
    assert r.returncode == 0, r.stderr
