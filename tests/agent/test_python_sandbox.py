"""The sandboxed Python tool: no files outside its temp dir, no network, limits enforced."""

import asyncio
import os
import socket
import time

import pytest

from megatron_gspo.agent.tools import ToolError, sandbox_os
from megatron_gspo.agent.tools.python_sandbox import _PIDS_ROOT, PythonSandbox, isolation_prefix


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


# Clears the policy the way an attacker would if it were reachable: module globals of
# `__main__`, frames via a traceback, and objects found by the garbage collector.
_BYPASS = r"""
import sys
def _clear(ns):
    for k in list(ns):
        v = ns[k]
        if isinstance(v, (set, dict, list)):
            v.clear()
        elif isinstance(v, tuple) and k.startswith('_DENY'):
            ns[k] = ()
    if '_tmp' in ns:
        ns['_tmp'] = ''
for how in ('main', 'frame', 'gc'):
    try:
        if how == 'main':
            _clear(sys.modules['__main__'].__dict__)
        elif how == 'frame':
            try:
                raise ValueError
            except ValueError as e:
                f = e.__traceback__.tb_frame
            while f is not None:
                _clear(f.f_globals)
                f = f.f_back
        else:
            import gc
            for o in gc.get_objects():
                if callable(o) and getattr(o, '__closure__', None):
                    for c in o.__closure__:
                        try:
                            if isinstance(c.cell_contents, frozenset):
                                c.cell_contents = frozenset()
                        except Exception:
                            pass
    except BaseException as e:
        print('bypass', how, 'failed:', type(e).__name__)
"""


def _ancestor_pids():
    pids, pid = [], os.getpid()
    while pid > 1:
        pids.append(pid)
        with open(f"/proc/{pid}/status") as f:
            pid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
    return pids


@pytest.mark.parametrize(
    "attack",
    [
        "print(open('/etc/passwd').read())",
        "import io; print(io.FileIO('/etc/passwd').read())",
        "import os; print(os.read(os.open('/etc/passwd', os.O_RDONLY), 200))",
        "import subprocess; print(subprocess.run(['id'], capture_output=True, text=True).stdout)",
        "import os; os.system('id')",
        "import pty; pty.spawn(['id'])",
        "import ctypes; print(ctypes.CDLL(None).system(b'id'))",
        "import importlib, os; importlib.reload(os); os.system('id')",
    ],
)
@pytest.mark.parametrize("isolate", [True, False])
def test_policy_cannot_be_cleared(attack, isolate):
    """Holds with the OS layers and with the audit hook alone."""
    sb = PythonSandbox(cpu_seconds=2, wall_timeout_s=10, isolate_network=isolate)
    rc, out, err, _ = run(sb, _BYPASS + attack)
    assert "root:" not in out and "uid=" not in out and "uid=" not in err, (out, err)
    assert "bypass main failed" not in out  # the old module globals are simply not there
    assert "bypass frame failed: PermissionError" in out and "bypass gc failed" in out


# User code that would run inside the audit hook (a path object's __fspath__, a finalizer)
# and walk up to the hook's frame to change its closure.
_IN_HOOK = r"""
import sys
class P:
    def __fspath__(self):
        f = sys._getframe(1)
        while f is not None:
            for v in list(f.f_locals.values()):
                for c in getattr(v, '__closure__', None) or ():
                    if isinstance(c.cell_contents, tuple):
                        c.cell_contents = ('',)
            f = f.f_back
        return '/etc/passwd'
for attempt in range(2):
    try:
        print(open(P()).read())
    except Exception as e:
        print('refused', type(e).__name__)
print(open('/etc/passwd').read())
"""


def test_user_code_never_runs_inside_the_hook(sb):
    rc, out, err, _ = run(sb, _IN_HOOK)
    assert "root:" not in out and "refused PermissionError" in out, (out, err)


def test_trainer_environment_and_outside_files_stay_out(tmp_path, monkeypatch):
    monkeypatch.setenv("GSPO_SANDBOX_SECRET", "s3cr3t-value")
    sb = PythonSandbox(cpu_seconds=2, wall_timeout_s=10, max_output_chars=20000)
    target = tmp_path / "outside.txt"
    code = _BYPASS + (
        "out = ''\n"
        f"for pid in {_ancestor_pids()!r} + [__import__('os').getppid()]:\n"
        "    try:\n"
        "        out += open(f'/proc/{pid}/environ').read()\n"
        "    except Exception as e:\n"
        "        out += repr(e)\n"
        "print(out)\n"
        f"try:\n    open({str(target)!r}, 'w').write('x')\n"
        "except Exception as e:\n    print(repr(e))\n"
    )
    rc, out, err, _ = asyncio.run(sb.run(code))
    assert "s3cr3t-value" not in out + err
    assert not target.exists()


@pytest.mark.skipif("--mount-proc" not in isolation_prefix(), reason="no mount namespace here")
def test_os_layer_alone_keeps_writes_inside(tmp_path):
    """Without the audit hook, the read-only mounts still stop writes outside the temp dir."""
    sb = PythonSandbox(cpu_seconds=2, wall_timeout_s=10)
    sb._audit_hook = False
    outside = [tmp_path / "f.txt", tmp_path / "fifo"]
    code = (
        "import os\nopen('in.txt', 'w').write('ok')\nprint(open('in.txt').read())\n"
        f"f, q = {str(outside[0])!r}, {str(outside[1])!r}\n"
        "for act in (lambda: open(f, 'w'), lambda: os.mkfifo(q)):\n"
        "    try:\n        act()\n    except OSError as e:\n        print('refused', e.errno)\n"
    )
    rc, out, err, _ = asyncio.run(sb.run(code))
    # in a root of its own the paths do not exist (ENOENT); else the mounts are read-only
    e = "2" if sandbox_os.new_root(isolation_prefix()) else "30"
    assert rc == 0 and out.split() == ["ok", "refused", e, "refused", e], (out, err)
    assert not any(p.exists() for p in outside)


def _has_pid_isolation():
    return "--pid" in isolation_prefix() or os.access(_PIDS_ROOT, os.W_OK)


@pytest.mark.skipif(not _has_pid_isolation(), reason="no PID namespace or pids cgroup here")
def test_no_descendant_outlives_the_run(tmp_path):
    """A setsid/double-forked child is dead when the tool returns, also after a timeout."""
    marker = tmp_path / "alive"
    shared = tmp_path
    os.chmod(shared, 0o777)
    child = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(1.5)\n"
        f"        open({str(marker)!r}, 'w').write('x')\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    for wall, tail in ((10, ""), (0.8, "time.sleep(30)\n")):
        sb = PythonSandbox(cpu_seconds=2, wall_timeout_s=wall)
        sb._audit_hook = False  # test the OS layer alone
        asyncio.run(sb.run(_BYPASS + child + tail))
        time.sleep(2.2)
        assert not marker.exists(), f"a descendant outlived the run (wall {wall})"


@pytest.mark.skipif(
    not os.access(_PIDS_ROOT, os.W_OK) and os.geteuid() == 0,
    reason="RLIMIT_NPROC does not bind root and there is no writable pids cgroup here",
)
def test_fork_bomb_is_bounded():
    sb = PythonSandbox(cpu_seconds=2, wall_timeout_s=10)
    sb._audit_hook = False  # the OS layer alone must bound it
    code = (
        "import os, time\nn = 0\n"
        "try:\n"
        "    for _ in range(400):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('stopped', n)\n"
        "print('forked', n)\n"
    )
    t0 = time.monotonic()
    rc, out, err, _ = asyncio.run(sb.run(code))
    assert "stopped" in out, (out, err)
    assert int(out.split()[-1]) <= sb.max_processes + 4  # + the launcher processes
    assert time.monotonic() - t0 < 8


def test_output_is_capped_while_reading():
    sb = PythonSandbox(cpu_seconds=3, wall_timeout_s=10, max_output_chars=100)
    code = "import sys\nfor _ in range(2000):\n    sys.stdout.write('z' * 10000)\n"
    rc, out, err, _ = asyncio.run(sb.run(code))
    assert len(out) <= 100 * 4 + 1024
    assert "z" * 100 in out
