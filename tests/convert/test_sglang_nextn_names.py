"""The multi-token-prediction tensors the exporter sends (`export_hf_weights(only_mtp=True)`: the
``model.layers.{num_hidden_layers}.*`` names of `convert.mtp`) are the ones SGLang 0.5.12's NEXTN
draft model loads, for DeepSeek-V3 (`DeepseekV3ForCausalLMNextN`) and GLM-4.5
(`Glm4MoeForCausalLMNextN`). SGLang's source is read as text (it needs CUDA to import):

1. its NEXTN loader's rule, checked in the source: the layer prefix is
   ``model.layers.{num_hidden_layers}`` (0 for a one-layer draft checkpoint); names without it,
   and ``shared_head.head`` / ``embed_tokens`` (taken from the target model), are skipped; the
   names holding one of ``nextn_spec_weight_names`` go to ``model.*``, the rest to
   ``model.decoder.*``; the target model's loader skips layer ids >= num_hidden_layers;
2. that rule applied to the exported names gives ``model.{enorm, hnorm, eh_proj,
   shared_head.norm}`` (attributes of the NextN model class) and ``model.decoder.*`` whose module
   names the decoder layer class's source mentions.
Skipped when SGLang's source is not installed (.sglang-cpu)."""

from __future__ import annotations

import ast
import re

import pytest

from megatron_gspo.convert import get_adapter
from megatron_gspo.convert.mtp import SPEC_NAMES
from tests.convert.test_sglang_names import _sglang_models
from tests.convert.tiny_families import FAMILIES

# (NextN model file, file with the NEXTN loader, file with the decoder layer class)
FILES = {
    "DeepseekV3ForCausalLM": ("deepseek_nextn.py", "deepseek_common/deepseek_weight_loader.py",
                              "deepseek_v2.py"),
    "Glm4MoeForCausalLM": ("glm4_moe_nextn.py", "glm4_moe.py", "glm4_moe.py"),
}


def _nextn_rename(names, num_hidden_layers: int) -> dict[str, str]:
    """SGLang 0.5.12's NEXTN renaming (deepseek_weight_loader.py / glm4_moe.py load_weights,
    is_nextn=True): exported name -> draft parameter name (skipped names left out)."""
    prefix = f"model.layers.{0 if num_hidden_layers == 1 else num_hidden_layers}"
    out = {}
    for name in names:
        if not name.startswith(prefix) or "shared_head.head" in name or "embed_tokens" in name:
            continue
        if any(s in name for s in SPEC_NAMES):
            out[name] = name.replace(prefix, "model")
        else:
            out[name] = name.replace(prefix, "model.decoder")
    return out


def _spec_names_in(src: str) -> set[str]:
    mo = re.search(r"nextn_spec_weight_names\s*=\s*(\[[^\]]*\])", src)
    assert mo, "no nextn_spec_weight_names list in SGLang's loader"
    return set(ast.literal_eval(mo.group(1)))


@pytest.mark.parametrize("arch", sorted(FILES))
def test_exported_mtp_names_are_what_sglang_nextn_loads(arch):
    models = _sglang_models()
    if models is None:
        pytest.skip("SGLang 0.5.12's source is not installed (.sglang-cpu)")
    nextn_src, loader_src, layer_src = ((models / f).read_text() for f in FILES[arch])
    # 1. the loader's rule, as written in SGLang
    assert _spec_names_in(loader_src) == set(SPEC_NAMES)
    assert re.search(r"0\s+if self\.config\.num_hidden_layers == 1\s+else "
                     r"self\.config\.num_hidden_layers", loader_src)
    assert 'f"model.layers.{nextn_layer_id}"' in loader_src
    assert re.search(r'"shared_head\.head" in name or "embed_tokens" in name', loader_src)
    assert 'replace(nextn_layer_prefix, "model.decoder")' in loader_src or \
        re.search(r'replace\(layer_prefix, "model\.decoder"\)', loader_src)
    assert re.search(r"int\(name_list\[2\]\)\s*>=\s*self\.config\.num_hidden_layers", loader_src)
    # 2. the exported names through it
    cfg = dict(FAMILIES[arch][1], num_nextn_predict_layers=1)
    adapter = get_adapter(cfg)
    n = cfg["num_hidden_layers"]
    sent = [h for h in adapter.hf_names(adapter.dims(cfg)) if h.startswith(f"model.layers.{n}.")]
    renamed = _nextn_rename(sent, n)
    skipped = set(sent) - set(renamed)
    assert skipped == {f"model.layers.{n}.embed_tokens.weight",
                       f"model.layers.{n}.shared_head.head.weight"}
    spec = {v for v in renamed.values() if not v.startswith("model.decoder.")}
    assert spec == {"model.enorm.weight", "model.hnorm.weight", "model.eh_proj.weight",
                    "model.shared_head.norm.weight"}
    for attr in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "decoder"):
        assert re.search(rf"self\.{re.escape(attr)} = ", nextn_src), attr
    decoder = [v for v in renamed.values() if v.startswith("model.decoder.")]
    assert any(".mlp.experts." in v for v in decoder) and any(".self_attn." in v for v in decoder)
    parts = set()
    for v in decoder:
        pieces = v.split(".")[2:-1]  # drop model.decoder and weight/bias
        parts.update(p for p in pieces if not p.isdigit())
    src = layer_src + loader_src  # fused names (gate_proj / up_proj) live in the loader's maps
    missing = sorted(p for p in parts if not re.search(rf"\b{re.escape(p)}\b", src))
    assert not missing, f"{arch}: decoder names SGLang's {FILES[arch][1:]} never mention: {missing}"
