"""`memory_mb` and `cpu_seconds` bound a python-tool call as a whole, not each of its processes
(issue 54, defect 3: with the default 16 processes one call held 1,750 MiB under `memory_mb:
256`). The program forks children that each allocate (or burn CPU) as an attacker past the
audit hook would (the hook, which refuses fork, is off: the OS layers must hold); a sampler in
the test reads, from /proc, what the call's processes hold together (proportional anonymous
memory, CPU time). With a cgroup (v1 or v2, where one can be made) the call's processes share
one memory and CPU budget; without one, the call is one process (fork refused by seccomp), so
its rlimits bound it."""

import asyncio
import os
import threading
import time

import pytest

from megatron_gspo.agent.tools import sandbox_cgroup, sandbox_os
from megatron_gspo.agent.tools.python_sandbox import PythonSandbox

MIB = 1 << 20

MEMORY = r"""
import os, time
kids = 0
for _ in range(8):
    try:
        pid = os.fork()
    except OSError as e:
        print("fork refused", e.errno)
        break
    if pid == 0:
        try:
            held = b"x" * (100 << 20)  # touched: resident
            time.sleep(2.5)
        finally:
            os._exit(0)
    kids += 1
for _ in range(kids):
    os.wait()
print("forked", kids)
"""

CPU = r"""
import os, time
kids = 0
for _ in range(4):
    try:
        pid = os.fork()
    except OSError as e:
        print("fork refused", e.errno)
        break
    if pid == 0:
        t = time.process_time()
        while time.process_time() - t < 3:
            pass
        os._exit(0)
    kids += 1
for _ in range(kids):
    os.wait()
print("forked", kids)
"""


class Sampler(threading.Thread):
    """Polls the processes whose command line names `marker`: the peak of their summed
    proportional anonymous memory (Pss_Anon) and the CPU time each used."""

    def __init__(self, marker: bytes):
        super().__init__(daemon=True)
        self.marker, self.stop, self.peak, self.cpu = marker, False, 0, {}

    def run(self):
        tick = os.sysconf("SC_CLK_TCK")
        while not self.stop:
            total = 0
            for pid in (p for p in os.listdir("/proc") if p.isdigit()):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if self.marker not in f.read():
                            continue
                    with open(f"/proc/{pid}/smaps_rollup") as f:
                        total += sum(int(line.split()[1]) * 1024 for line in f
                                     if line.startswith("Pss_Anon:"))
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    self.cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
                except (OSError, ValueError, IndexError):
                    continue
            self.peak = max(self.peak, total)
            time.sleep(0.02)


def _measure(monkeypatch, code, **limits):
    made = []
    real = sandbox_os.make_temp_dir

    def make_temp_dir():
        made.append(real())
        return made[-1]

    monkeypatch.setattr(sandbox_os, "make_temp_dir", make_temp_dir)
    sb = PythonSandbox(wall_timeout_s=30, max_output_chars=2000, **limits)
    sb._audit_hook = False  # an attacker past the Python layer: the OS layers must hold

    async def go():
        task = asyncio.ensure_future(sb.run(code))
        while not made:
            await asyncio.sleep(0.001)
        sampler = Sampler(made[0].encode())
        sampler.start()
        try:
            return await task, sampler
        finally:
            sampler.stop = True
            sampler.join()

    (rc, out, err, _), sampler = asyncio.run(go())
    return out, err, sampler.peak, sum(sampler.cpu.values())


def _modes():
    return ["cgroup" if sandbox_cgroup.available() else pytest.param(
        "cgroup", marks=pytest.mark.skip(reason="no cgroup can be made here")), "fallback"]


@pytest.fixture(params=_modes())
def mode(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(sandbox_cgroup, "make", lambda *a, **k: None)
    return request.param


def test_memory_mb_bounds_the_call_as_a_whole(monkeypatch, mode):
    out, err, peak, _ = _measure(monkeypatch, MEMORY, memory_mb=256, max_disk_mb=1,
                                 cpu_seconds=10)
    print(f"{mode}: the call held {peak / MIB:.0f} MiB at most under memory_mb 256 ({out!r})")
    assert peak > 90 * MIB or "fork refused" in out, (out, err)  # the probe allocated
    assert peak <= (256 + 1) * MIB, f"one call held {peak / MIB:.0f} MiB ({out}, {err})"
    if mode == "fallback":
        assert "fork refused 1" in out, (out, err)


def test_cpu_seconds_bound_the_call_as_a_whole(monkeypatch, mode):
    out, err, _, cpu = _measure(monkeypatch, CPU, cpu_seconds=1, memory_mb=256)
    print(f"{mode}: the call used {cpu:.2f} CPU s under cpu_seconds 1 ({out!r})")
    assert cpu <= 1.5, f"one call used {cpu:.2f} CPU seconds ({out}, {err})"


def test_cgroup_v2_layout(tmp_path, monkeypatch):
    """The v2 path on a stand-in hierarchy (this host's controllers are on v1): the trainer's
    cgroup is asked to delegate memory and pids, the call's cgroup gets memory.max, pids.max,
    and its CPU seconds come from cpu.stat; a cgroup that cannot delegate gives None."""
    mount = tmp_path / "cgroup"
    (mount / "trainer").mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("cpu memory pids\n")
    (mount / "trainer" / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(sandbox_cgroup, "V1", str(mount))
    monkeypatch.setattr(sandbox_cgroup, "_own_paths", lambda: {"": "/trainer"})
    find = sandbox_cgroup.parents.__wrapped__  # uncached
    where = find()
    assert where == {"v2": str(mount / "trainer")}
    assert (mount / "trainer" / "cgroup.subtree_control").read_text() == "+memory +pids"
    monkeypatch.setattr(sandbox_cgroup, "parents", lambda: where)
    cg = sandbox_cgroup.make(20, 300 * MIB)
    d = mount / "trainer" / os.path.basename(cg.dirs["v2"])
    assert (d / "memory.max").read_text() == str(300 * MIB)
    assert (d / "pids.max").read_text() == "20"
    assert cg.procs == [str(d / "cgroup.procs")]
    (d / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    assert cg.cpu_s() == 1.5
    # a cgroup with processes of its own cannot delegate (EBUSY): no cgroup, one process
    (mount / "trainer" / "cgroup.subtree_control").unlink()
    (mount / "trainer" / "cgroup.subtree_control").mkdir()
    assert find() == {}
