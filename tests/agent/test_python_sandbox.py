"""The sandboxed Python tool: no files outside its temp dir, no network, limits enforced."""

import asyncio
import socket
import time

import pytest

from megatron_gspo.agent.tools import ToolError
from megatron_gspo.agent.tools.python_sandbox import PythonSandbox


@pytest.fixture(scope="module")
def sb():
    return PythonSandbox(cpu_seconds=1, memory_mb=256, wall_timeout_s=10, max_output_chars=200)


def run(sb, code):
    return asyncio.run(sb.run(code))


def test_runs_code_and_uses_its_temp_dir(sb):
    rc, out, _, _ = run(
        sb,
        "import math, json, os\nopen('a.txt', 'w').write('hi')\n"
        "print(open('a.txt').read(), math.factorial(5), sorted(os.listdir('.')))",
    )
    assert rc == 0 and out.strip() == "hi 120 ['a.txt', 'main.py']"
    assert asyncio.run(sb({"code": "print(2 + 2)"})) == "4"


@pytest.mark.parametrize(
    "code",
    [
        "print(open('/etc/passwd').read())",
        "import pathlib; print(pathlib.Path('/etc/passwd').read_text())",
        "import os; fd = os.open('/etc/passwd', os.O_RDONLY); print(os.read(fd, 100))",
        "import os; print(os.listdir('/etc'))",
        "open('../escape.txt', 'w').write('x')",
        "import os; os.symlink('/etc/passwd', 'p'); print(open('p').read())",
        "import os; os.link('/etc/passwd', 'p'); print(open('p').read())",
        "import os; os.chdir('/'); print(open('etc/passwd').read())",
    ],
)
def test_cannot_read_or_write_outside_temp_dir(sb, code):
    rc, out, err, _ = run(sb, code)
    assert rc != 0 and "root:" not in out and "sandbox:" in err


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess; subprocess.run(['cat', '/etc/passwd'])",
        "import os; os.system('cat /etc/passwd')",
        "import os; os.execv('/bin/cat', ['cat', '/etc/passwd'])",
        "import ctypes",
        "import os; os.fork()",
    ],
)
def test_no_processes_or_ctypes(sb, code):
    rc, out, err, _ = run(sb, code)
    assert rc != 0 and "root:" not in out and "sandbox:" in err


@pytest.mark.parametrize("isolate", [True, False])
def test_network_refused(isolate):
    """Refused by the audit hook, with or without a separate network namespace."""
    sb = PythonSandbox(cpu_seconds=1, wall_timeout_s=10, isolate_network=isolate)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    try:
        for code in (
            f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
            f"import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port}))",
            f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}')",
        ):
            rc, _, err, _ = run(sb, code)
            assert rc != 0 and "sandbox:" in err, (code, err)
        srv.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection ever reached the listener
            srv.accept()
    finally:
        srv.close()


def test_limits_kill(sb):
    t0 = time.monotonic()
    rc, _, _, timed_out = run(sb, "while True: pass")  # CPU limit 1 s
    assert rc is None or rc < 0 or timed_out
    quick = PythonSandbox(cpu_seconds=1, wall_timeout_s=0.7)
    rc, _, _, timed_out = run(quick, "import time; time.sleep(30)")  # wall clock 0.7 s
    assert timed_out and rc is None
    assert time.monotonic() - t0 < 25
    rc, _, err, _ = run(sb, "x = bytearray(1024 ** 3)")  # RLIMIT_AS 256 MB
    assert rc != 0 and "MemoryError" in err
    with pytest.raises(ToolError, match="time limit"):
        asyncio.run(quick({"code": "import time; time.sleep(30)"}))
    out = asyncio.run(sb({"code": "print('y' * 10000)"}))
    assert "output truncated" in out and len(out) < 300
    assert "exit code 1" in asyncio.run(sb({"code": "raise SystemExit(1)"}))
