"""docker/build.sh checks what it needs before it downloads or runs anything as root (issue 54,
defect 13): a missing docker client, an unreachable daemon, an empty --tag or --base, and a base
image that would need root each end with one line naming the problem, with no wheelhouse fetched
and no debootstrap run. Fake `docker`, `debootstrap` and `python3` programs record each call."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_DOCKER = """#!/bin/sh
echo "docker $*" >> "$CALLS"
case "$1" in
  version)
    if [ -n "$DAEMON_DOWN" ]; then
      echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock." >&2; exit 1
    fi
    echo 27.3.1 ;;
  buildx) exit 0 ;;
  image) exit 1 ;;
esac
"""
RECORDER = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CALLS"
"""


@pytest.fixture
def fakes():
    tmp_path = Path(tempfile.mkdtemp(prefix="build-sh-"))  # reachable by another user
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("docker", FAKE_DOCKER), ("debootstrap", RECORDER),
                       ("fetchpython", RECORDER)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    tmp_path.chmod(0o755)
    calls = tmp_path / "calls"
    calls.touch()
    calls.chmod(0o666)
    yield bindir, calls
    shutil.rmtree(tmp_path)


def _build(fakes, *args, as_user=False, **env):
    bindir, calls = fakes
    run_env = dict(os.environ, PATH=f"{bindir}:/usr/bin:/bin", CALLS=str(calls),
                   PYTHON=str(bindir / "fetchpython"), **env)
    cmd = ["bash", str(ROOT / "docker" / "build.sh"), "cpu", *args]
    if as_user:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=60)
    return out, calls.read_text().splitlines()


def _one_error(out) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("build.sh: ")]
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr)
    return lines[0]


def test_a_missing_docker_client_is_named_before_anything_runs(fakes):
    out, calls = _build(fakes, DOCKER="no-such-docker")
    assert "docker client 'no-such-docker' not found" in _one_error(out)
    assert calls == []  # no wheelhouse fetch, no debootstrap


def test_a_daemon_that_does_not_answer_is_named(fakes):
    out, calls = _build(fakes, DAEMON_DOWN="1")
    line = _one_error(out)
    assert "docker daemon not reachable" in line and "Cannot connect" in line, line
    assert calls == ["docker version -f {{.Server.Version}}"]


@pytest.mark.parametrize("flag", ["--tag", "--base"])
def test_an_empty_tag_or_base_is_refused(fakes, flag):
    out, calls = _build(fakes, flag, "")
    assert f"{flag} needs" in _one_error(out) and calls == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to run the script as another user (setpriv)")
def test_a_base_image_that_needs_root_is_refused_before_debootstrap(fakes):
    out, calls = _build(fakes, as_user=True)
    refusal = [ln for ln in out.stderr.splitlines() if "needs root" in ln]
    assert out.returncode == 2 and len(refusal) == 1 and "--base IMAGE" in refusal[0], out.stderr
    assert not any(c.startswith("debootstrap") for c in calls), calls
