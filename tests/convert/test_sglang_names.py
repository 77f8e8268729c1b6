"""The HF names the exporter sends for each family beyond Llama / Qwen are names SGLang
0.5.12's model class for that family knows: every module / parameter name of an exported
tensor occurs in the class's source (`sglang/srt/models/<file>.py` of the installed SGLang, read
as text: SGLang needs CUDA to import). Skipped when SGLang's source is not installed."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from megatron_gspo.convert import get_adapter
from tests.convert.tiny_families import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
FILES = {
    "DeepseekV3ForCausalLM": ["deepseek_v2.py", "deepseek_common/deepseek_weight_loader.py"],
    "Gemma3ForCausalLM": ["gemma3_causal.py"],
    "Glm4MoeForCausalLM": ["glm4_moe.py"],
    "GptOssForCausalLM": ["gpt_oss.py"],
}


def _sglang_models() -> Path | None:
    for base in (ROOT / ".sglang-cpu", Path("/work/main/.sglang-cpu")):
        hits = glob.glob(str(base / "venv/lib/python3*/site-packages/sglang/srt/models"))
        if hits:
            return Path(hits[0])
    return None


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_exported_names_are_known_to_sglang(arch):
    models = _sglang_models()
    if models is None:
        pytest.skip("SGLang 0.5.12's source is not installed (.sglang-cpu)")
    src = "\n".join((models / f).read_text() for f in FILES[arch])
    cfg = dict(FAMILIES[arch][1])
    adapter = get_adapter(cfg)
    names = set(adapter.hf_names(adapter.dims(cfg)))
    parts = set()
    for n in names:
        pieces = n.split(".")
        if pieces[-1] in ("weight", "bias"):
            pieces = pieces[:-1]
        parts.update(p for p in pieces[-2:] if not p.isdigit() and p != "model")
    missing = sorted(p for p in parts if not re.search(rf"\b{re.escape(p)}\b", src))
    assert not missing, f"{arch}: names SGLang's {FILES[arch]} never mention: {missing}"
