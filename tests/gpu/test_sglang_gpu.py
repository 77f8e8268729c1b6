"""The SGLang client against a real SGLang server on a GPU (skipped without CUDA or sglang)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang"),
]


def test_real_sglang_server(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    from gpu_sglang_check import run_checks

    assert run_checks(str(tmp_path))
