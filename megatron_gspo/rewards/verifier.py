"""Hugging Face `math-verify` (parse + verify) with a hard time limit per comparison.

math-verify's own timeout uses `signal.alarm`, which works only on the main thread (it raises
ValueError elsewhere) and cannot cut a hang inside C code. Here every comparison runs in a
long-lived worker process (a plain `python -c` program that imports only math_verify; the
kernel kills it when its parent dies) that the caller waits on with `select`; a comparison
that passes its limit kills the worker, counts as "not verified" and the next call starts a
fresh one. This works from any thread and costs one pipe round trip per comparison (the
worker's start-up, ~0.5 s, is not charged to the limit).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

_WORKER = r"""
import sys
sys.path.pop(0)  # never import modules from the working directory
import json, logging, os, signal, threading, time
parent = int(sys.argv[1])
try:  # Linux: the kernel kills this worker when its parent dies, even inside C code
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except Exception:
    pass

def _orphan_watch():  # elsewhere: notice a new parent between bytecodes
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)

threading.Thread(target=_orphan_watch, daemon=True).start()
logging.disable(logging.WARNING)  # "timeout is disabled": the parent enforces the limit
from math_verify import parse, verify
out = sys.stdout
out.write('{"ready": true}\n'); out.flush()
for line in sys.stdin:
    req = json.loads(line)
    try:
        gold = parse(req["gold"], parsing_timeout=None)
        pred = parse(req["answer"], parsing_timeout=None)
        ok = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))
        out.write(json.dumps({"ok": ok, "parsed": bool(gold) and bool(pred)}) + "\n")
    except Exception as e:
        out.write(json.dumps({"ok": False, "parsed": False,
                              "error": type(e).__name__ + ": " + str(e)[:200]}) + "\n")
    out.flush()
"""

STARTUP_TIMEOUT_S = 120.0


class VerifierError(RuntimeError):
    """The math-verify worker cannot be started (e.g. math-verify is not installed)."""


class MathVerifier:
    """One math-verify worker process, shared by the threads of this process.

    Attributes:
        timeouts: comparisons cut at their time limit so far.
        crashes: comparisons whose worker died (counted as not verified).
        calls: comparisons made so far.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pid = os.getpid()
        self.timeouts = 0
        self.crashes = 0
        self.calls = 0

    def _start(self) -> subprocess.Popen:
        # PR_SET_PDEATHSIG fires when the *thread* that started the worker ends, so workers
        # are started from one long-lived thread of this process (`_spawner`), never from the
        # caller's thread (a server's thread per request would take the worker with it).
        proc = _spawner().submit(
            subprocess.Popen, [sys.executable, "-c", _WORKER, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            bufsize=1, close_fds=True).result()
        line = self._read_line(proc, STARTUP_TIMEOUT_S)
        if line is None or not line.startswith('{"ready"'):
            err = ""
            if proc.poll() is not None and proc.stderr is not None:
                lines = proc.stderr.read().strip().splitlines()
                err = f": {lines[-1]}" if lines else ""
            self._kill(proc)
            raise VerifierError(f"math-verify worker did not start{err} (install "
                                "'math-verify[antlr4_13_2]')")
        proc.stderr.close()  # nothing more is read from it; keep the pipe from filling
        return proc

    @staticmethod
    def _read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
        """One line of the worker's stdout within timeout_s; None on timeout, "" on exit."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                return proc.stdout.readline()  # "" when the worker closed its end (died)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None and not f.closed:
                f.close()

    def verify(self, gold: str, answer: str, timeout_s: float = 5.0) -> bool:
        """math-verify's `verify(parse(gold), parse(answer))` within timeout_s seconds.

        Args:
            gold: the reference, e.g. "$\\frac{1}{2}$" or "\\boxed{(1,2]}".
            answer: the model's answer or whole response (math-verify extracts from it).
            timeout_s: limit for parsing both and comparing; past it the comparison is cut.
        Returns:
            True when equivalent; False when not, when either side does not parse, or on
            timeout (counted in `timeouts`). A worker that dies under a comparison (counted in
            `crashes`) is replaced and the comparison asked once more.
        """
        if not timeout_s > 0:
            raise ValueError(f"math-verify timeout_s must be > 0 seconds, got {timeout_s}")
        with self._lock:
            ok = self._compare(gold, answer, timeout_s)
            if ok is None:  # the worker died under this comparison: once more on a fresh one
                ok = self._compare(gold, answer, timeout_s)
            return bool(ok)

    def _compare(self, gold: str, answer: str, timeout_s: float) -> bool | None:
        """One comparison (lock held); None when the worker died during it (a crash)."""
        if self._pid != os.getpid():  # a forked child: the parent's worker is not ours
            self._proc, self._pid = None, os.getpid()
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        proc = self._proc
        self.calls += 1
        try:
            proc.stdin.write(json.dumps({"gold": gold, "answer": answer}) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError):  # died before the question got through
            self.crashes += 1
            self._proc = None
            self._kill(proc)
            return None
        line = self._read_line(proc, timeout_s)
        if not line:  # None: past the limit (a timeout); "": the worker died (a crash)
            crashed = line == "" or proc.poll() is not None
            if crashed:
                self.crashes += 1
            else:
                self.timeouts += 1
            self._proc = None
            self._kill(proc)
            return None if crashed else False
        return bool(json.loads(line).get("ok", False))

    def close(self) -> None:
        """Stop the worker (a later `verify` starts a new one)."""
        with self._lock:
            if self._proc is not None:
                self._kill(self._proc)
                self._proc = None


_SPAWNER: tuple[int, ThreadPoolExecutor] | None = None
_SPAWNER_LOCK = threading.Lock()


def _spawner() -> ThreadPoolExecutor:
    """The one thread of this process that starts workers (lives as long as the process)."""
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None or _SPAWNER[0] != os.getpid():  # none yet, or a forked child
            _SPAWNER = (os.getpid(), ThreadPoolExecutor(1, "math-verify-spawner"))
        return _SPAWNER[1]


_DEFAULT: MathVerifier | None = None
_DEFAULT_LOCK = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier used by the `math` rewards."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = MathVerifier()
        return _DEFAULT


_REPORTED = {"calls": 0, "timeouts": 0, "crashes": 0}  # totals at the last verifier_counts()


def verifier_counts(since_last: bool = True) -> dict[str, float]:
    """The process-wide verifier's counters as metrics: `rewards/verifier_calls`,
    `rewards/verifier_timeouts`, `rewards/verifier_crashes` ({} while none was used).

    Args:
        since_last: counts since the previous call (per training step, so a resumed run logs
            the same numbers as an uninterrupted one); False: totals since start.
    """
    v = _DEFAULT
    if v is None:
        return {}
    now = {"calls": v.calls, "timeouts": v.timeouts, "crashes": v.crashes}
    out = {f"rewards/verifier_{k}": float(n - (_REPORTED[k] if since_last else 0))
           for k, n in now.items()}
    if since_last:
        _REPORTED.update(now)
    return out
