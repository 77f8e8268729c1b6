"""Optional tier: our launch command lines, port rule, context length and API-key decision
against SGLang 0.5.12's own `ServerArgs`, `ModelConfig` and `decide_request_auth`. Needs the
pieces of scripts/sglang_pieces.sh (MEGATRON_GSPO_SGLANG_PIECES, default .sglang-pieces), which
also installs the packages server_args imports (pyzmq, openai, ...; an older pieces folder may
name them in a folder given by MEGATRON_GSPO_SGLANG_EXTRA); skipped without them. Runs in a
subprocess so SGLang's import-time patches stay out of this process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIECES = Path(os.environ.get("MEGATRON_GSPO_SGLANG_PIECES", ROOT / ".sglang-pieces"))
EXTRA = os.environ.get("MEGATRON_GSPO_SGLANG_EXTRA", "")
WORKER = Path(__file__).with_name("_sglang_args_worker.py")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (PIECES / "sglang").is_dir(),
                                 reason=f"no SGLang pieces in {PIECES} (scripts/sglang_pieces.sh)")]


@pytest.fixture(scope="module")
def result():
    path = [str(ROOT), str(PIECES)] + ([EXTRA] if EXTRA else [])
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(path))
    out = subprocess.run([sys.executable, str(WORKER)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    skip = next((x for x in out.stdout.splitlines() if x.startswith("SKIP ")), None)
    if skip:
        pytest.skip(skip[5:])
    return json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])


def test_sglang_parses_our_launch_argv(result):
    assert result["parsed"] == result["expected"]


def test_picked_ports_and_port_rule_match_sglang(result):
    assert result["picked_refused"] == []
    for case, (theirs, ours) in result["port_rule"].items():
        assert theirs == ours, case
    assert result["port_rule"]["60000/None"][0] is not None  # the rule does refuse


def test_context_length_and_api_key_decision_match_sglang(result):
    for case, (theirs, ours) in result["context"].items():
        assert theirs == ours, case
    for case, (theirs, ours) in result["auth"].items():
        assert theirs == ours, case
