"""docker/launch/disaggregated.sh's servers do not inherit the learner-only environment of the
image: docker/Dockerfile sets CUDA_DEVICE_MAX_CONNECTIONS=1 for Megatron (the learner), which
serialises a server's kernels (the same rule as rollout/sglang/launch.py's LEARNER_ONLY_ENV for
the servers the learner launches itself). The servers started for real, with a stand-in
"python" that prints the environment it got."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.docker.test_launch_scripts import CLEAN_ENV, LAUNCH, ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"


def test_image_sets_the_learner_setting_the_servers_must_not_get():
    assert re.search(r"^\s*CUDA_DEVICE_MAX_CONNECTIONS=1\b", DOCKERFILE.read_text(), re.M)


def test_disaggregated_servers_start_without_cuda_device_max_connections(tmp_path: Path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nenv\n")  # a "server" that prints its environment and exits
    fake.chmod(0o755)
    logs = tmp_path / "logs"
    e = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    # one server: the script stops the others once the first exits (they might not have run)
    e.update(GPUS_PER_NODE="1", PYTHON=str(fake), LOG_DIR=str(logs), ROLLOUT_DTYPE="float32",
             CUDA_DEVICE_MAX_CONNECTIONS="1", CUDA_VISIBLE_DEVICES="0,1")
    r = subprocess.run(["bash", str(LAUNCH / "disaggregated.sh"), "rollout", str(tmp_path)],
                       env=e, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert "an SGLang server exited" in r.stderr, r.stderr  # the stand-in exits at once
    got = sorted(logs.glob("sglang_*_*.log"))
    assert len(got) == 1
    for log in got:
        env = dict(ln.split("=", 1) for ln in log.read_text().splitlines() if "=" in ln)
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env, log.name
        assert env.get("CUDA_VISIBLE_DEVICES") == "0,1"  # the rest is passed on
