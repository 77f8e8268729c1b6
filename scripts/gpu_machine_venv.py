"""A virtual environment holding only the GPU check machine's packages plus the kit's, for the
CPU dry run of scripts/gpu_checks.sh: every distribution of this interpreter that
scripts/gpu_machine_packages.txt or scripts/gpu_wheels.txt names is linked into DIR's
site-packages (CPU torch stands in for the machine's CUDA build), with the requirements of
the machine's distributions as installed here (this interpreter's versions of them may need
other packages than the machine's versions do, e.g. a newer huggingface-hub); nothing else.
The kit's wheels are installed without their requirements on the machine, so theirs are not
added: tests/gpu/test_gpu_checks_dry_run.py checks they are on the machine.

    .venv/bin/python scripts/gpu_machine_venv.py DIR     # then DIR/bin/python

Prints the linked distributions and, for the names this interpreter lacks, one line each
(e.g. triton, which a CPU machine does not need). Exit 1 when a kit pin is missing here.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINE = ROOT / "scripts" / "gpu_machine_packages.txt"
KIT = ROOT / "scripts" / "gpu_wheels.txt"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names_of(path: Path) -> set[str]:
    """Distribution names of a one-a-line list (`name` or `name==version`, # comments)."""
    out = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.add(norm(re.split(r"[=<>!~ ]", line, maxsplit=1)[0]))
    return out


def _tops(dist) -> set[tuple[str, ...]]:
    return {Path(str(f)).parts[:1] for f in (dist.files or [])
            if not str(f).startswith("..") and Path(str(f)).parts}


def requirement_names(dist) -> set[str]:
    """Names of `dist`'s requirements that apply here (no extras)."""
    from packaging.requirements import Requirement

    out = set()
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.add(norm(req.name))
    return out


def closure(names: set[str], dists: dict) -> set[str]:
    """`names` and, transitively, the requirements of those installed here."""
    todo, seen = [n for n in names if n in dists], set(names)
    while todo:
        for r in requirement_names(dists[todo.pop()]):
            if r not in seen:
                seen.add(r)
                if r in dists:
                    todo.append(r)
    return seen


def build(target: Path) -> tuple[list[str], list[str]]:
    """Make the venv at `target`. Returns (linked distributions, listed names absent here)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(target)],
                   check=True)
    site_rel = Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
    site = target / site_rel
    here = Path(sysconfig.get_path("purelib"))
    dists = {norm(d.metadata["Name"]): d for d in md.distributions(path=[str(here)])}
    listed = names_of(MACHINE) | names_of(KIT)
    allowed = closure(names_of(MACHINE), dists) | names_of(KIT)
    owners: dict[str, set[str]] = {}
    for name, d in dists.items():
        for (top,) in _tops(d):
            owners.setdefault(top, set()).add(name)
    linked = sorted(n for n in dists if n in allowed)
    for name in linked:
        for f in dists[name].files or []:
            parts = Path(str(f)).parts
            if not parts or str(f).startswith(".."):
                continue
            top = parts[0]
            shared = not owners[top] <= allowed and (here / top).is_dir() and len(parts) > 1
            rel = Path(*parts[:2]) if shared else Path(top)
            dst = site / rel
            if dst.exists() or dst.is_symlink():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(here / rel)
    return linked, sorted(listed - set(dists))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-4].strip(), file=sys.stderr)
        return 2
    linked, absent = build(Path(args[0]))
    print(f"{args[0]}: {len(linked)} distributions linked: {', '.join(linked)}")
    print(f"not in this interpreter ({len(absent)}): {', '.join(absent)}")
    missing_kit = sorted(names_of(KIT) - set(linked))
    for name in missing_kit:
        print(f"kit pin {name} is not installed here: install it first")
    return 1 if missing_kit else 0


if __name__ == "__main__":
    sys.exit(main())
