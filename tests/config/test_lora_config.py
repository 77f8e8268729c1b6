"""`model.lora` config: typed fields, unknown targets and settings LoRA would ignore are
one-line errors naming the field."""

from __future__ import annotations

import pytest

from megatron_gspo.config import ConfigError, load_config

BASE = "examples/tiny/config.yaml"


def test_lora_off_by_default_and_on_with_overrides():
    assert load_config(BASE).model.lora.rank == 0
    cfg = load_config(BASE, overrides=["model.lora.rank=8", "model.lora.alpha=16",
                                       "model.lora.targets=[qkv, fc2]"])
    assert cfg.model.lora.rank == 8 and cfg.model.lora.targets == ["qkv", "fc2"]


@pytest.mark.parametrize("overrides, field", [
    (["model.lora.rank=4", "model.lora.targets=[qkv, mlp]"], "model.lora.targets: unknown "
                                                              "target 'mlp'"),
    (["model.lora.alpha=32"], "model.lora.alpha: set while model.lora.rank is 0"),
    (["model.lora.rank=4", "model.lora.targets=[]"], "model.lora.targets: needs at least one"),
    (["model.lora.rank=4", "algorithm.kl_coef=0.1", "model.reference_path=/x"],
     "model.reference_path: not used with model.lora"),
    (["model.lora.rnk=4"], "model.lora.rnk: unknown key"),
])
def test_lora_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
        load_config(BASE, overrides=overrides)
