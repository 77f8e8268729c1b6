"""The sandbox's view of the host, its uid and its interpreter (issue 43 item 1), with the
audit hook off (the attacker already won the Python layer):
- in a root of its own, `os.stat`/`os.access` find no host path (/etc/passwd, the repo, /work,
  the test's own dir, root's home beyond the interpreter), while the standard library imports;
- the program runs as uid/gid 65534 (nobody) outside, with no capability;
- `_ctypes` is neither loaded nor importable in the model's interpreter;
- the seccomp filter lets an execve through only with the first stage's key."""

import asyncio
import os
import struct
import threading
import time

import psutil
import pytest

from megatron_gspo.agent.tools import sandbox_seccomp
from megatron_gspo.agent.tools.python_sandbox import PythonSandbox, isolation_prefix

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# as real root with mount and PID namespaces, the sandbox must get a root of its own
needs_root = pytest.mark.skipif(os.geteuid() != 0 or "--mount-proc" not in isolation_prefix(),
                                reason="no root of its own without real root and namespaces")


def _sandbox(**kw) -> PythonSandbox:
    sb = PythonSandbox(cpu_seconds=3, wall_timeout_s=30, max_output_chars=20000, **kw)
    sb._audit_hook = False
    return sb


@needs_root
def test_host_paths_do_not_exist_in_the_sandbox(tmp_path):
    home = [os.path.join("/root", n) for n in os.listdir("/root") if n != ".pyenv"][:5]
    probe = tmp_path / "outside.txt"
    probe.write_text("x")
    paths = ["/etc/passwd", "/etc/shadow", "/etc/hostname", "/work", ROOT,
             os.path.join(ROOT, "README.md"), str(probe), str(tmp_path), "/var",
             "/usr/bin/env", "/proc/1", *home]
    code = (
        "import os, json, decimal, zlib, collections, re, math\n"
        f"for p in {paths!r}:\n"
        "    print('SEEN' if os.path.lexists(p) or os.access(p, os.F_OK) else 'absent', p)\n"
        "print('stdlib', json.dumps({'a': math.factorial(5)}), zlib.crc32(b'a'))\n"
    )
    rc, out, err, _ = asyncio.run(_sandbox().run(code))
    assert rc == 0, err
    assert "SEEN" not in out and out.count("absent") == len(paths), out
    assert f"stdlib {{\"a\": 120}} {__import__('zlib').crc32(b'a')}" in out, out


def _run_and_watch(sb: PythonSandbox, code: str) -> tuple[tuple, list[dict]]:
    """Runs `code` while sampling the credentials of the run's processes from the host."""
    seen: list[dict] = []
    result: list = []
    t = threading.Thread(target=lambda: result.append(asyncio.run(sb.run(code))))
    me = psutil.Process()
    t.start()
    while t.is_alive():
        for q in me.children(recursive=True):
            try:
                cl = q.cmdline()  # the model's interpreter: python -I -S -c BOOTSTRAP ...
                if "-c" in cl and "def _boot" in cl[cl.index("-c") + 1]:
                    status = open(f"/proc/{q.pid}/status").read()
                    fields = dict(line.split(":\t", 1) for line in status.splitlines()
                                  if ":\t" in line)
                    seen.append({k: fields[k].split() for k in ("Uid", "Gid", "Groups",
                                                                  "CapEff", "CapPrm")})
            except (psutil.Error, OSError, KeyError, ValueError):
                pass
        time.sleep(0.02)
    t.join()
    return result[0], seen


@needs_root
def test_runs_as_nobody_outside_with_no_capabilities():
    code = "import time\ntime.sleep(1.5)\nprint('done')\n"
    (rc, out, err, _), seen = _run_and_watch(_sandbox(), code)
    assert rc == 0 and "done" in out, err
    assert seen, "the model's interpreter was never seen running"
    for s in seen:
        assert s["Uid"] == ["65534"] * 4 and s["Gid"] == ["65534"] * 4, s
        assert s["Groups"] == [] and s["CapEff"] == s["CapPrm"] == ["0000000000000000"], s


@pytest.mark.parametrize("isolate", [True, False])
def test_ctypes_is_neither_loaded_nor_importable(isolate):
    code = (
        "import sys, importlib\n"
        "print('loaded', sorted(m for m in sys.modules if 'ctypes' in m))\n"
        "print('types', sum(1 for c in object.__subclasses__() if 'ctypes' in c.__module__))\n"
        "for name in ('_ctypes', 'ctypes'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        print('IMPORTED', name)\n"
        "    except ImportError:\n"
        "        print('refused', name)\n"
    )
    rc, out, err, _ = asyncio.run(_sandbox(isolate_network=isolate).run(code))
    assert rc == 0, err
    assert "loaded []" in out and "types 0" in out, out
    assert "IMPORTED" not in out and out.count("refused") == 2, out


def test_exec_key_is_the_only_way_through_the_filter():
    prog = sandbox_seccomp.filter_program("x86_64")
    key = 0x0123456789ABCDEF
    keyed = sandbox_seccomp.with_exec_key(prog, key)
    ops = [struct.unpack_from("=HBBI", keyed, i) for i in range(0, len(keyed), 8)]
    i = next(j for j, o in enumerate(ops) if o[0] == 0x15 and o[3] == 59)  # jeq execve
    gate = i + 1 + ops[i][1]
    assert ops[gate] == (0x20, 0, 0, 40) and ops[gate + 1][3] == key & 0xFFFFFFFF
    assert ops[gate + 2] == (0x20, 0, 0, 44) and ops[gate + 3][3] == key >> 32
    assert ops[gate + 4] == (0x06, 0, 0, 0x7FFF0000)  # only then: allow
    for k in (gate + 1, gate + 3):  # a wrong half: EPERM
        assert ops[k + 1 + ops[k][2]] == (0x06, 0, 0, 0x00050000 | 1)
    assert 322 in [o[3] for o in ops if o[0] == 0x15]  # execveat stays refused outright
    with pytest.raises(ValueError, match="exec key"):
        sandbox_seccomp.with_exec_key(keyed, key)  # the slots are gone once filled
