"""Training against SGLang's real CPU server (tier `sglang_real`): the tiny demo trains 20 steps
with `rollout.engine=sglang` on a server the trainer launches and its reward rises as with the
embedded engine, every weight sync verified by the probe (`rollout.verify_sync_interval=1`);
kill -9 of the trainer leaves no server behind and the run resumes; async mode runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.rollout import _sglang_real as tier

tier.require_tier()
pytestmark = pytest.mark.sglang_real

COMMON = ["train.eval_interval=0", "logging.progress_bar=false", "logging.tensorboard=false",
          "logging.log_samples=0"]


def _cmd(run_dir, *extra):
    return [sys.executable, "-m", "megatron_gspo.cli", "train", "examples/tiny/config.yaml",
            "--run-dir", str(run_dir), *COMMON, *tier.train_args(), *extra]


def _env(tag):
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2", TIER_RUN_TAG=tag)


def _tagged(tag) -> list[tuple[int, str]]:
    """(pid, command line) of live processes whose environment holds TIER_RUN_TAG=tag."""
    out, needle = [], f"TIER_RUN_TAG={tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out.append((int(pid), cmd))
    return out


def _servers(tag):
    return [p for p in _tagged(tag) if "sglang.launch_server" in p[1]]


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(1500)
def test_tiny_demo_trains_20_steps_on_a_real_server(tmp_path):
    run, tag = tmp_path / "run", uuid.uuid4().hex
    t0 = time.monotonic()
    out = subprocess.run(_cmd(run, "train.max_steps=20", "checkpoint.interval=0"),
                         cwd=tier.ROOT, env=_env(tag), capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(20))
    reward = [r["reward/mean"] for r in rows]
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    probe = [r["weight_sync/probe_max_diff"] for r in rows if "weight_sync/probe_max_diff" in r]
    print(f"real-server demo: {time.monotonic() - t0:.0f} s, reward {first:.2f} -> {last:.2f}, "
          f"probe max diff {max(probe):.2g}")
    assert last > first + 0.1, (first, last, reward)  # as the embedded demo's test
    assert len(probe) >= 19 and max(probe) < 1e-3  # every sync verified (fp32)
    assert _servers(tag) == []


def test_kill_9_leaves_no_server_and_the_run_resumes(tmp_path):
    run, tag = tmp_path / "run", uuid.uuid4().hex
    steps = ["train.max_steps=4", "checkpoint.interval=2"]
    proc = subprocess.Popen(_cmd(run, *steps), cwd=tier.ROOT, env=_env(tag),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = run / "checkpoints" / "step_00000002" / "COMPLETE"
    deadline = time.time() + 900
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), f"no checkpoint (trainer exit code {proc.poll()})"
    assert _servers(tag), "no real server was running: the test would prove nothing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 60
    while _tagged(tag) and time.time() < deadline:
        time.sleep(0.2)
    left = _tagged(tag)
    for pid, _ in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes outlived the killed trainer: {left}"
    out = subprocess.run(_cmd(run, *steps, "train.resume=auto"), cwd=tier.ROOT, env=_env(tag),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed from" in (run / "events.log").read_text()
    assert sorted({r["step"] for r in _metrics(run)}) == [0, 1, 2, 3]
    assert _servers(tag) == []


def test_async_mode_on_a_real_server(tmp_path):
    run, tag = tmp_path / "run", uuid.uuid4().hex
    out = subprocess.run(_cmd(run, "train.max_steps=4", "checkpoint.interval=0",
                              "rollout.mode=async", "rollout.max_staleness=1",
                              "rollout.colocate=false"),
                         cwd=tier.ROOT, env=_env(tag), capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert _servers(tag) == []
