"""Megatron-Core's MoE router without Transformer Engine and without the CPU layer.

megatron-core 0.16.1 binds `te_general_gemm` in `transformer/moe/moe_utils.py` only inside its
TE import and reads it on every router call; a CUDA machine without TE (the CPU layer does
nothing there) raised NameError at the first MoE forward. Importing the model builder binds the
missing name, whatever the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = r"""
import json, torch
import megatron_gspo.megatron.models.builder  # the builder: every learner and converter uses it
from megatron.core.transformer.moe import moe_utils
from megatron_gspo.megatron import cpu
inp, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
out = moe_utils.router_gating_linear(inp, w, None, torch.float32)
out.sum().backward()
print(json.dumps({"have_te": moe_utils.HAVE_TE, "cpu_layer": cpu.enabled(),
                  "close": bool(torch.allclose(out, inp @ w.t())),
                  "grad": bool(torch.allclose(inp.grad, w.sum(0).expand(3, 4)))}))
"""


def test_router_runs_without_te_and_without_the_cpu_layer():
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["have_te"] is False and got["cpu_layer"] is False
    assert got["close"] and got["grad"]
