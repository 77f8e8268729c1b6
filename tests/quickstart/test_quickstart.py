"""The two-command quick start: README, quickstart.sh and .ci/run agree, and the set-up step
installs once and then skips the install while pyproject.toml is unchanged.

The set-up tests run the real script in a scratch copy of the repository root with a stand-in
`python3` (it creates a `.venv` whose `python` only records its arguments), so no package is
installed and no network is used.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "quickstart.sh"

FAKE_PYTHON = r"""#!/usr/bin/env bash
# stand-in interpreter: `-m venv DIR` makes DIR/bin/python (this same stand-in); anything else
# is appended to $QS_LOG; exit status $QS_RC (default 0) for `-m pip`.
if [ "$1" = "-c" ]; then exit 0; fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && chmod +x "$3/bin/python"
    printf '#!/usr/bin/env bash\necho megatron-gspo "$@" >> "$QS_LOG"\n' > "$3/bin/megatron-gspo"
    chmod +x "$3/bin/megatron-gspo"
    echo "venv $3" >> "$QS_LOG"; exit 0
fi
echo "$*" >> "$QS_LOG"
if [ "$2" = "pip" ]; then exit "${QS_RC:-0}"; fi
exit 0
"""


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block, "README quick start has no bash block"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip()]


def test_readme_quick_start_is_two_commands_and_ci_runs_the_test_one():
    cmds = _readme_commands()
    assert cmds == ["./quickstart.sh demo", "./quickstart.sh test"], cmds
    ci = (ROOT / ".ci" / "run").read_text()
    ci_lines = [ln.strip() for ln in ci.splitlines()]
    assert cmds[1] in ci_lines, ".ci/run does not call the README's test command as written"
    # CI runs the suite only through that command (no second, diverging pytest call) ...
    assert not [ln for ln in ci_lines if "pytest" in ln and not ln.startswith(("#", "echo"))]
    # ... and keeps its shellcheck install and its "no tests collected" check.
    assert "apt-get install -y -qq shellcheck" in ci
    assert '"$rc" -eq 5' in ci
    script = SCRIPT.read_text()
    assert 'exec "$VENV/bin/python" -m pytest "$@"' in script
    assert "examples/tiny/config.yaml" in script
    assert os.access(SCRIPT, os.X_OK), "quickstart.sh must be executable"


def test_quickstart_scripts_pass_shellcheck():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck binary not installed (apt-get install -y shellcheck)")
    r = subprocess.run([exe, str(SCRIPT), str(ROOT / ".ci" / "run")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture
def sandbox(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy2(SCRIPT, root / "quickstart.sh")
    shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    log.touch()
    env = {**os.environ, "PYTHON": str(fake), "QS_LOG": str(log)}
    env.pop("QS_RC", None)

    def run(*args: str, **extra: str) -> tuple[subprocess.CompletedProcess, list[str], float]:
        before = log.read_text().splitlines()
        t0 = time.monotonic()
        r = subprocess.run([str(root / "quickstart.sh"), *args], capture_output=True, text=True,
                           env={**env, **extra}, timeout=60)
        dt = time.monotonic() - t0
        return r, log.read_text().splitlines()[len(before):], dt

    return root, run


def test_setup_installs_once_then_skips_in_seconds(sandbox):
    root, run = sandbox
    r, calls, _ = run("setup")
    assert r.returncode == 0, r.stderr
    assert calls == ["venv .venv", "-m pip install torch==2.13.0",
                     "-m pip install -e .[dev]"], calls  # torch first, then the package
    r, calls, dt = run("setup")
    assert r.returncode == 0, r.stderr
    assert calls == [], f"second set-up reinstalled: {calls}"
    assert "install skipped" in r.stderr
    assert dt < 5.0, f"second set-up took {dt:.1f}s"
    # the test command: same set-up (skipped), then pytest with the given arguments
    r, calls, dt = run("test", "-q", "tests/x.py")
    assert r.returncode == 0, r.stderr
    assert calls == ["-m pytest -q tests/x.py"], calls
    assert dt < 5.0
    r, calls, _ = run("demo", "train.max_steps=2")
    assert calls == ["megatron-gspo train examples/tiny/config.yaml train.max_steps=2"], calls


def test_setup_reinstalls_after_pyproject_change_or_failed_install(sandbox):
    root, run = sandbox
    assert run("setup")[0].returncode == 0
    with open(root / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    r, calls, _ = run("setup")
    assert calls == ["-m pip install torch==2.13.0", "-m pip install -e .[dev]"], calls
    # a failing install leaves no stamp: the next run installs again
    with open(root / "pyproject.toml", "a") as f:
        f.write("# changed again\n")
    r, calls, _ = run("setup", QS_RC="1")
    assert r.returncode != 0
    r, calls, _ = run("setup")
    assert r.returncode == 0 and calls[-1] == "-m pip install -e .[dev]", calls
    r, calls, _ = run("setup")
    assert calls == []


def test_unknown_command_is_a_usage_error(sandbox):
    _, run = sandbox
    r, calls, _ = run("deploy")
    assert r.returncode == 2 and "usage: ./quickstart.sh demo|test" in r.stderr
    assert calls == []
