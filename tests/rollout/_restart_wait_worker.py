"""A torchrun worker of one round, as `ServerProcess` sees it (tests/rollout/
test_restart_waits_for_servers.py starts each round as its child, so every round has the same
parent: the torchrun agent). Arguments: OUT_DIR MODE, MODE one of

- `old`: launch a stand-in server whose exit takes DIE seconds once its guard is gone (on a
  GPU: the driver tearing down its memory; `never`: it does not end), print the guard's pid,
  then wait to be killed;
- `new`: launch a stand-in server that writes the time it started;
- `new-short`: as `new`, with a 1.5 s bound on the wait; print the one-line error.
"""

import json
import os
import sys
import time

from megatron_gspo.rollout.sglang.launch import ServerProcess
from megatron_gspo.runtime import server_record
from megatron_gspo.runtime.rundir import RunError

OLD = """
import ctypes, os, signal, sys, time
out, die = sys.argv[1], sys.argv[2]
def ending(*_):
    if die == "never":
        return
    time.sleep(float(die))
    with open(os.path.join(out, "old_exit"), "w") as f:
        f.write(repr(time.time()))
    os._exit(0)
signal.signal(signal.SIGTERM, ending)
ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG: its guard died
with open(os.path.join(out, "old_pid"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""

NEW = """
import os, sys, time
with open(os.path.join(sys.argv[1], "new_start"), "w") as f:
    f.write(repr(time.time()))
time.sleep(60)
"""


def main(out: str, mode: str, die: str = "3") -> None:
    gpu = ["--base-gpu-id", "0", "--tp-size", "2"]
    if mode == "old":
        proc = ServerProcess([sys.executable, "-c", OLD, out, die, *gpu], "stand-in server 0")
        print(json.dumps({"guard": proc.proc.pid}), flush=True)
        time.sleep(600)
    if mode == "new-short":
        server_record.WAIT_S = 1.5
    t0 = time.time()
    try:
        proc = ServerProcess([sys.executable, "-c", NEW, out, *gpu], "stand-in server 0")
    except RunError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return
    while not os.path.exists(os.path.join(out, "new_start")):
        time.sleep(0.05)
    path = server_record.record_path()
    record = json.loads(path.read_text())["servers"] if path.exists() else []
    print(json.dumps({"asked": t0, "record": record}), flush=True)
    proc.stop(grace_s=2)


if __name__ == "__main__":
    main(*sys.argv[1:])
