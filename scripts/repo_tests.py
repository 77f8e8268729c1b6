"""Bind the module name `tests` to this repository's tests folder.

The folder is a namespace package (no `__init__.py`, so pytest's rootdir imports stay as they
are); Python's import system prefers a regular package named `tests` found anywhere on sys.path
(site-packages, the GPU kit's `pip --target` folder: some wheels ship one) over namespace
portions, whatever their order on the path, and `tests.megatron` would then not import. The
GPU kit's scripts call `bind()` before importing from `tests`.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bind(root: Path = ROOT) -> None:
    """Make `import tests.<x>` resolve under `root / "tests"` in this process."""
    folder = str(root / "tests")
    if folder in list(getattr(sys.modules.get("tests"), "__path__", [])):
        return
    spec = importlib.machinery.ModuleSpec("tests", None, is_package=True)
    spec.submodule_search_locations = [folder]
    sys.modules["tests"] = importlib.util.module_from_spec(spec)
