"""`mcore-to-hf`'s config guards on the families beyond Llama / Qwen: the expert count is read
from the family's own field (`n_routed_experts` for DeepSeek-V3 and GLM-4.5 MoE,
`num_local_experts` for gpt-oss), the family's routing, shared-expert, leading-dense-layer and
MLA fields are compared with the stored config, and the tensor shapes of checkpoints written
layer by layer (dense and MoE layers, MLA) are checked too."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.convert.param_map import ConversionError
from megatron_gspo.convert.guards import compare_configs
from megatron_gspo.megatron.io import conversion as conv
from tests.convert.tiny_families import FAMILIES, make_family_model

ROOT = Path(__file__).resolve().parents[2]
DS, GLM, OSS, GEMMA = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "GptOssForCausalLM",
                       "Gemma3ForCausalLM")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fam")
    out = {}
    for arch in FAMILIES:
        make_family_model(arch, root / arch)
        out[arch] = root / arch
    return out


@pytest.fixture(scope="module")
def ckpts(hf_dirs, tmp_path_factory):
    """Converted checkpoints (hf-to-mcore, one process), converted when first asked for."""
    root, done = tmp_path_factory.mktemp("ck"), {}

    def get(arch):
        if arch not in done:
            p = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tools" /
                                "convert_checkpoint.py"), "hf-to-mcore", "--hf",
                                str(hf_dirs[arch]), "--out", str(root / arch), "--no-progress"],
                               capture_output=True, text=True, timeout=300, cwd=ROOT)
            assert p.returncode == 0, p.stderr[-3000:]
            done[arch] = root / arch
        return done[arch]
    return get


def _cfg(hf_dirs, arch, **edits):
    cfg = json.loads((hf_dirs[arch] / "config.json").read_text())
    for k, v in edits.items():
        cfg.pop(k) if v is None else cfg.__setitem__(k, v)
    return cfg


MISMATCHES = [
    (GLM, "n_routed_experts", 4), (DS, "n_routed_experts", 4), (OSS, "num_local_experts", 4),
    (GLM, "n_shared_experts", 2), (DS, "first_k_dense_replace", 2), (GLM, "n_group", 2),
    (DS, "topk_group", 4), (DS, "routed_scaling_factor", 1.0), (OSS, "swiglu_limit", 7.0),
    (DS, "kv_lora_rank", 8), (DS, "v_head_dim", 8), (DS, "n_group", None),  # default 8, not 4
    # attention of the sliding-window families
    (GEMMA, "sliding_window", 6), (GEMMA, "query_pre_attn_scalar", 16),
    (GEMMA, "layer_types", ["full_attention"] * 6), (GEMMA, "attn_logit_softcapping", 50.0),
    (OSS, "sliding_window", 128), (OSS, "layer_types", ["full_attention", "sliding_attention"] * 2),
]


@pytest.mark.parametrize("arch, field, value", MISMATCHES)
def test_family_field_differing_from_the_stored_config_is_refused(hf_dirs, arch, field, value):
    stored = _cfg(hf_dirs, arch)
    with pytest.raises(ConversionError, match=f"\\({field}(, |\\s)") as e:
        compare_configs(_cfg(hf_dirs, arch, **{field: value}), stored, "given", "stored")
    assert "\n" not in str(e.value)


def test_gemma3_rope_in_either_spelling(hf_dirs):
    """Gemma 3's two rotary bases and the global layers' scaling compare the same whether a
    config.json spells them as transformers 5 writes them (`rope_parameters` keyed by layer
    type) or as 4.x did (`rope_theta`, `rope_scaling`, `rope_local_base_freq`,
    `sliding_window_pattern`); a different base of either kind is refused naming it."""
    stored = _cfg(hf_dirs, GEMMA)
    assert "full_attention" in stored["rope_parameters"]  # the 5.x spelling
    old = _cfg(hf_dirs, GEMMA, rope_parameters=None, layer_types=None, rope_theta=1e6,
               rope_local_base_freq=1e4, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    compare_configs(old, stored, "given", "stored")
    for edits, field in (({"rope_local_base_freq": 5e4}, "rope_local_base_freq"),
                         ({"rope_theta": 5e5}, "rope_theta"),
                         ({"rope_scaling": None}, "rope_scaling"),
                         ({"sliding_window_pattern": 3}, "layer_types")):
        with pytest.raises(ConversionError, match=f"\\({field}(, |\\s)") as e:
            compare_configs({**old, **edits}, stored, "given", "stored")
        assert "\n" not in str(e.value)
    nested = json.loads(json.dumps(stored))
    nested["rope_parameters"]["sliding_attention"]["rope_theta"] = 5e4
    with pytest.raises(ConversionError, match="rope_local_base_freq"):
        compare_configs(nested, stored, "given", "stored")


def test_family_defaults_left_out_are_the_same_model(hf_dirs):
    """GLM's n_group / topk_group 1, gpt-oss's swiglu_limit, window and layer pattern are
    transformers' defaults."""
    compare_configs(_cfg(hf_dirs, GLM, n_group=None, topk_group=None),
                    _cfg(hf_dirs, GLM), "given", "stored")
    compare_configs(_cfg(hf_dirs, OSS, swiglu_limit=None),
                    _cfg(hf_dirs, OSS, swiglu_limit=7.0), "given", "stored")
    # gpt-oss's window 128 and alternating layers (sliding first) are transformers' defaults
    compare_configs(_cfg(hf_dirs, OSS, sliding_window=None, layer_types=None),
                    _cfg(hf_dirs, OSS, sliding_window=128), "given", "stored")


def _shapes_only(ck, cfg, tmp_path):
    """`check_mcore_to_hf` of a copy of `ck` without its stored config, given `cfg`."""
    c = tmp_path / "ck"
    shutil.copytree(ck, c)
    shutil.rmtree(c / "hf_config")
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return conv.check_mcore_to_hf(str(c), str(d), str(tmp_path / "o"), False)


def _slow(arch):  # the per-layer checkpoints (DeepSeek-V3, GLM) in the default tier
    return arch if arch in (DS, GLM) else pytest.param(arch, marks=pytest.mark.slow)


@pytest.mark.parametrize("arch", [_slow(a) for a in sorted(FAMILIES)])
def test_each_familys_own_config_matches_its_tensors(ckpts, hf_dirs, arch, tmp_path):
    _shapes_only(ckpts(arch), _cfg(hf_dirs, arch), tmp_path)


@pytest.mark.parametrize("arch, edits, field", [
    (GLM, {"n_routed_experts": 4}, "n_routed_experts"),
    (GLM, {"moe_intermediate_size": 8}, "moe_intermediate_size"),
    (GLM, {"n_shared_experts": 2}, "n_shared_experts"),
    (GLM, {"first_k_dense_replace": 2}, "first_k_dense_replace"),
    (GLM, {"num_hidden_layers": 3}, "num_hidden_layers"),
    (GLM, {"attention_bias": False}, "attention_bias"),
    (DS, {"n_routed_experts": 16}, "n_routed_experts"),
    (DS, {"kv_lora_rank": 8}, "kv_lora_rank"),
    (DS, {"q_lora_rank": 12}, "q_lora_rank"),
    (DS, {"v_head_dim": 8}, "v_head_dim"),
    pytest.param(OSS, {"num_local_experts": 4}, "num_local_experts", marks=pytest.mark.slow),
])
def test_family_mismatch_found_from_tensor_shapes_alone(ckpts, hf_dirs, arch, edits, field,
                                                        tmp_path):
    with pytest.raises(ConversionError, match=field) as e:
        _shapes_only(ckpts(arch), _cfg(hf_dirs, arch, **edits), tmp_path)
    assert "\n" not in str(e.value)


# The config attributes SGLang 0.5.12's DeepSeek model class reads without a default or a
# hasattr check (python/sglang/srt/models/deepseek_v2.py: DeepseekV2ForCausalLM, its decoder
# layers, MoE and MLA attention); a config.json without one of them does not load there.
SGLANG_DEEPSEEK_V2_READS = (
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "max_position_embeddings", "rms_norm_eps",
    "hidden_act", "tie_word_embeddings", "pad_token_id", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "n_group", "topk_group", "topk_method", "scoring_func",
    "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace", "moe_layer_freq",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)


def test_deepseek_config_written_by_mcore_to_hf_has_what_sglang_reads(ckpts, hf_dirs, tmp_path):
    """The config.json `mcore-to-hf` writes for a DeepSeek-V3 checkpoint (the stored one, kept
    as it is) carries every attribute SGLang's model class reads, and a rotary setting in
    either spelling (`rope_parameters`, or `rope_theta` with `rope_scaling`)."""
    kw = conv.check_mcore_to_hf(str(ckpts(DS)), None, str(tmp_path / "o"), False)
    cfg = kw["write_config"] or json.loads((Path(kw["side_dir"]) / "config.json").read_text())
    missing = [k for k in SGLANG_DEEPSEEK_V2_READS if k not in cfg]
    assert missing == [], missing
    assert "rope_parameters" in cfg or "rope_theta" in cfg
