"""The kernel keeps the Python sandbox's reads inside its temp dir (and the interpreter's own
files): plain opens, directory fds of `/`, and the rename race that fools the audit hook's
textual `..` resolution, directly and through the calculator environment."""

import asyncio
import json
import os
import time

import pytest

from megatron_gspo.agent.env import make_env_factory
from megatron_gspo.agent.tools import sandbox_os
from megatron_gspo.agent.tools.python_sandbox import PythonSandbox, SandboxUnavailable

SECRET = "trainer-secret-5f1c9a"


@pytest.fixture
def secret(tmp_path):
    """A file only the trainer's user can read, as /etc/shadow is."""
    path = tmp_path / "secret.txt"
    path.write_text(SECRET + "\n")
    os.chmod(path, 0o600)
    return str(path)


def _reads(secret: str) -> str:
    """Every direct way to read `secret` and /etc/shadow (the audit hook off: the OS alone)."""
    return (
        "import os\n"
        f"targets = [{secret!r}, '/etc/shadow']\n"
        "def attempts(t):\n"
        "    yield lambda: open(t).read()\n"
        "    yield lambda: os.read(os.open(t, os.O_RDONLY), 200).decode()\n"
        "    yield lambda: os.read(os.open(t.lstrip('/'), os.O_RDONLY, dir_fd=os.open(\n"
        "                                  '/', os.O_RDONLY | os.O_DIRECTORY)), 200)\n"
        "    yield lambda: os.read(os.open(t.lstrip('/'), os.O_RDONLY,\n"
        "                                  dir_fd=os.open('/', os.O_PATH)), 200).decode()\n"
        "    yield lambda: os.listdir(os.path.dirname(t))\n"
        "    yield lambda: os.execv('/bin/cat', ['cat', t])\n"
        "for t in targets:\n"
        "    for i, a in enumerate(attempts(t)):\n"
        "        try:\n"
        "            print('READ', i, a())\n"
        "        except OSError as e:\n"
        "            print('refused', i, e.errno)\n"
    )


@pytest.mark.parametrize("isolate", [True, False])
def test_os_alone_refuses_reads_outside(secret, isolate):
    sb = PythonSandbox(cpu_seconds=2, wall_timeout_s=20, max_output_chars=20000,
                       isolate_network=isolate)
    sb._audit_hook = False
    rc, out, err, _ = asyncio.run(sb.run(_reads(secret)))
    assert rc == 0, err
    assert SECRET not in out and "root:" not in out and "READ" not in out, out
    assert out.count("refused") == 12, out
    # the interpreter's own files and the temp dir stay usable
    rc, out, err, _ = asyncio.run(sb.run(
        "import os, zlib, json, decimal\nopen('a', 'w').write('x')\n"
        "print(len(open(os.__file__).read()) > 0, open('a').read(), zlib.crc32(b'a'))"))
    assert rc == 0 and out.split() == ["True", "x", str(__import__("zlib").crc32(b"a"))], err


def test_calculator_env_python_tool_reads_nothing_outside(secret, monkeypatch):
    """The config's path (agent.python_tool: true -> CalculatorEnv's python tool, a hermes tool
    call), with the audit hook off so that only the OS stands in the way."""
    monkeypatch.setattr(PythonSandbox, "_audit_hook", False)
    env = make_env_factory("calculator", {
        "python_tool": True, "tool_timeout_s": 30, "max_tool_output_chars": 20000,
        "python_kwargs": {"cpu_seconds": 2, "wall_timeout_s": 20, "max_output_chars": 20000}})()
    asyncio.run(env.reset({"prompt": "2+2?", "label": 4}))
    out = asyncio.run(env.step(_tool_call(_reads(secret)))).observation[0]["content"]
    assert SECRET not in out and "root:" not in out and "READ" not in out, out
    assert out.count("refused") == 12, out


def test_refuses_without_landlock(monkeypatch):
    monkeypatch.setattr(sandbox_os, "landlock_abi", lambda: 0)
    with pytest.raises(SandboxUnavailable, match="no Landlock"):
        PythonSandbox()
    sb = PythonSandbox(require_landlock=False)  # the explicit opt-out: the hook alone
    rc, out, _, _ = asyncio.run(sb.run("print(open('/etc/passwd').read())"))
    assert rc != 0 and "root:" not in out


def test_config_check_refuses_python_tool_without_landlock(monkeypatch):
    from pathlib import Path

    from megatron_gspo.config import ConfigError, load_config
    from megatron_gspo.loop.early_checks import _check_agent

    config = Path(__file__).resolve().parents[2] / "examples/multiturn_agent/config_cpu.yaml"
    cfg = load_config(config, ["agent.python_tool=true"])
    _check_agent(cfg)
    monkeypatch.setattr(sandbox_os, "landlock_abi", lambda: 0)
    with pytest.raises(ConfigError, match="agent.python_tool: this kernel has no Landlock"):
        _check_agent(cfg)
    _check_agent(load_config(config, ["agent.python_tool=false"]))


# One thread renames m1/m2/d to d and back; the other opens d's deep subdirectory and climbs
# back up as many `..` as it went down. The hook sees the temp dir; when a rename lands in the
# middle of the kernel's walk, the walk climbs two levels too many and ends at `/`. Each landing
# (a dir fd whose inode is that of `/`) then tries the files through `dir_fd`.
_RACE = r"""
import os, threading, time
N = 40
deep = 'm1/m2/d/' + '/'.join('e%d' % i for i in range(N))
os.makedirs(deep)
path = deep + '/..' * (N + 3)
root = os.stat('/')
stop = []
def flip():
    while not stop:
        os.rename('m1/m2/d', 'd')
        os.rename('d', 'm1/m2/d')
t = threading.Thread(target=flip)
t.start()
landed, tries, t0 = 0, 0, time.time()
while time.time() - t0 < DURATION and landed < 3:
    tries += 1
    flags = (os.O_PATH if tries % 2 else os.O_RDONLY) | os.O_DIRECTORY
    try:
        fd = os.open(path, flags)
    except OSError:
        continue
    st = os.fstat(fd)
    if (st.st_ino, st.st_dev) == (root.st_ino, root.st_dev):
        landed += 1
        for t_ in TARGETS:
            try:
                f = os.open(t_.lstrip('/'), os.O_RDONLY, dir_fd=fd)
                print('READ', os.read(f, 200).decode())
            except OSError as e:
                print('refused', e.errno)
    os.close(fd)
stop.append(1)
t.join()
print('landed', landed, 'tries', tries)
"""


def _race(secret: str, seconds: float) -> str:
    return _RACE.replace("DURATION", str(seconds)).replace("TARGETS", repr([secret, "/etc/shadow"]))


def _landed(out: str) -> int:
    line = [ln for ln in out.splitlines() if ln.startswith("landed")]
    return int(line[-1].split()[1]) if line else 0


def _tool_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + \
        "</tool_call>"


@pytest.mark.slow
@pytest.mark.parametrize("via", ["sandbox", "calculator_env"])
def test_rename_race_reads_nothing_outside(secret, via):
    """Runs the race (up to 150 s) until it has landed on `/`; nothing outside is read."""
    kw = {"cpu_seconds": 40, "wall_timeout_s": 30, "max_output_chars": 20000}
    if via == "sandbox":
        sb = PythonSandbox(**kw)

        def call(code):
            rc, out, err, _ = asyncio.run(sb.run(code))
            return out + err
    else:  # the config's path: agent.python_tool: true, limits through agent.env_kwargs
        env = make_env_factory("calculator", {
            "python_tool": True, "tool_timeout_s": 40, "max_tool_output_chars": 20000,
            "python_kwargs": kw})()
        asyncio.run(env.reset({"prompt": "2+2?", "label": 4}))

        def call(code):
            res = asyncio.run(env.step(_tool_call(code)))
            return res.observation[0]["content"]

    landed, outs, t0 = 0, [], time.monotonic()
    while landed == 0 and time.monotonic() - t0 < 150:
        out = call(_race(secret, 20))
        outs.append(out)
        assert SECRET not in out and "root:" not in out and "READ" not in out, out
        assert "landed" in out, out
        landed += _landed(out)
    print(f"{via}: the race landed on / {landed} times in {time.monotonic() - t0:.0f} s")
    if landed == 0:
        pytest.skip("the race never landed on / in 150 s (a busy machine?): nothing shown")
    assert all("refused 13" in o for o in outs if _landed(o)), outs
