"""The kernel, not the Python audit hook, stops a program that has already beaten the hook
(issue 43 item 1): the program runs with the hook never installed, as after an attacker
emptied the interpreter's hook list through `_ctypes`, and still reaches no unix socket of the
host (a listener on a pathname socket outside gets no connection) and execs nothing from a
memfd (a static ELF that would print PWNED)."""

import asyncio
import os
import platform
import socket
import struct

import pytest

from megatron_gspo.agent.tools import sandbox_seccomp
from megatron_gspo.agent.tools.python_sandbox import PythonSandbox


def _static_elf() -> bytes:
    """A static x86_64 ELF executable: write(1, "PWNED\\n", 6); exit(0)."""
    code = bytes.fromhex("b801000000" "bf01000000" "488d3510000000" "ba06000000" "0f05"
                         "b83c000000" "31ff" "0f05") + b"PWNED\n"
    base, start = 0x400000, 64 + 56
    ehdr = struct.pack("<4sBBBBB7xHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0, 2, 62, 1,
                       base + start, 64, 0, 0, 64, 56, 1, 0, 0, 0)
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, start + len(code),
                       start + len(code), 0x1000)
    return ehdr + phdr + code


ESCAPE = r"""
import os, socket, sys
def attempt(name, fn):
    try:
        print(name, 'ESCAPED', fn())
    except OSError as e:
        print(name, 'refused', e.errno)
    sys.stdout.flush()
def unix_connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(LISTENER)
    s.sendall(b'hello from the sandbox')
    return 'connected'
def unix_dgram():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.connect(LISTENER)
    return 'connected'
def pair():
    a, b = socket.socketpair()
    return 'pair'
def forked_exec(name, exec_it):
    # the child reports a refused exec; an exec that works prints PWNED (the ELF)
    sys.stdout.flush()
    try:
        pid = os.fork()
    except OSError as e:  # no cgroup here: the call is one process, fork refused too
        print(name, 'refused', e.errno)
        return
    if pid == 0:
        try:
            exec_it()
        except OSError as e:
            print(name, 'refused', e.errno)
            sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
def memfd():
    fd = os.memfd_create('x', 0)
    os.write(fd, ELF)
    return fd
attempt('unix_stream', unix_connect)
attempt('unix_dgram', unix_dgram)
attempt('socketpair', pair)
if ELF:
    try:
        fd = memfd()
    except OSError as e:
        print('memfd_create refused', e.errno)
        fd = os.open('.', os.O_RDONLY | os.O_DIRECTORY)
    forked_exec('memfd_proc', lambda: os.execv('/proc/self/fd/%d' % fd, ['x']))
    forked_exec('memfd_fexecve', lambda: os.execve(fd, ['x'], {}))  # execveat(AT_EMPTY_PATH)
    with open('prog', 'wb') as f:
        f.write(ELF)
    os.chmod('prog', 0o755)
    forked_exec('file_exec', lambda: os.execv('./prog', ['prog']))
"""


@pytest.fixture
def listener(tmp_path):
    path = str(tmp_path / "outside.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(4)
    srv.setblocking(False)
    yield path, srv
    srv.close()


def test_program_past_the_audit_hook_reaches_no_unix_socket_and_execs_nothing(listener):
    path, srv = listener
    elf = _static_elf() if platform.machine() == "x86_64" else b""
    sb = PythonSandbox(cpu_seconds=3, wall_timeout_s=30, max_output_chars=20000)
    sb._audit_hook = False  # the attacker already won the Python layer
    code = f"LISTENER = {path!r}\nELF = {elf!r}\n" + ESCAPE
    rc, out, err, _ = asyncio.run(sb.run(code))
    assert rc == 0, err
    assert "ESCAPED" not in out and "PWNED" not in out, out
    expected = 7 if elf else 3
    assert out.count("refused") == expected, out
    with pytest.raises(BlockingIOError):  # no connection ever reached the listener
        srv.accept()


def test_the_elf_and_the_listener_work_outside_the_sandbox(listener, tmp_path):
    """The probe is real: the same ELF prints PWNED and the listener accepts, unconfined."""
    import subprocess

    path, srv = listener
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(path)
    srv.setblocking(True)
    srv.accept()[0].close()
    c.close()
    if platform.machine() != "x86_64":
        pytest.skip("the test ELF is x86_64 machine code")
    exe = tmp_path / "prog"
    exe.write_bytes(_static_elf())
    exe.chmod(0o755)
    assert subprocess.run([str(exe)], capture_output=True).stdout == b"PWNED\n"


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_seccomp_filter_checks_the_architecture_first(arch):
    prog = sandbox_seccomp.filter_program(arch)
    ops = [struct.unpack_from("=HBBI", prog, i) for i in range(0, len(prog), 8)]
    audit = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[arch]
    assert ops[0] == (0x20, 0, 0, 4)  # load seccomp_data.arch
    assert ops[1][0] == 0x15 and ops[1][3] == audit and ops[1][1] == 0
    assert ops[1 + 1 + ops[1][2]] == (0x06, 0, 0, 0x80000000)  # foreign arch: kill
    with pytest.raises(ValueError, match="architecture"):
        sandbox_seccomp.filter_program("mips")


def test_daemon_threads_at_exit_are_not_reported_as_killed():
    """glibc loads libgcc_s when a daemon thread exits at interpreter shutdown: it must be
    readable, else the run aborts and the model is told "[killed (CPU or memory limit)]"."""
    sb = PythonSandbox(cpu_seconds=3, wall_timeout_s=30)
    code = ("import threading, time\n"
            "def spin():\n"
            "    while True:\n"
            "        sum(range(1000))\n"
            "for _ in range(4):\n"
            "    threading.Thread(target=spin, daemon=True).start()\n"
            "time.sleep(0.05)\n"
            "print('done')\n")
    for _ in range(3):
        assert asyncio.run(sb({"code": code})) == "done"


@pytest.mark.parametrize("isolate", [True, False])
def test_installed_packages_in_the_stdlib_dir_stay_out(isolate):
    """pyenv keeps site-packages inside lib/python3.X, the standard library's directory: its
    files stay unreadable (and, in the mount namespace, unlisted) with the hook off."""
    import sysconfig

    site = os.path.join(sysconfig.get_paths()["stdlib"], "site-packages")
    names = [n for n in os.listdir(site) if os.path.isfile(os.path.join(site, n))
             ] if os.path.isdir(site) else []
    if not names:
        pytest.skip("no site-packages with files inside the standard library's directory")
    sb = PythonSandbox(cpu_seconds=3, wall_timeout_s=30, max_output_chars=20000,
                       isolate_network=isolate)
    sb._audit_hook = False
    target = os.path.join(site, names[0])
    code = (f"import os, json\n"
            f"try:\n    print('READ', open({target!r}, 'rb').read(20))\n"
            f"except OSError as e:\n    print('refused', e.errno)\n"
            f"print('LISTED', len(os.listdir({site!r})))\n"
            f"print(json.dumps([1]), len(open(os.__file__).read()) > 0)\n")
    rc, out, err, _ = asyncio.run(sb.run(code))
    assert rc == 0, err
    assert "READ" not in out and "refused" in out and "[1] True" in out, out
    if isolate:
        assert "LISTED 0" in out, out
