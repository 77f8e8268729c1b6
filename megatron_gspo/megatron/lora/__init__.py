"""LoRA on the learner: the adapters on Megatron-Core's linear layers (adapters), and their
checkpoints and PEFT files (io). `convert lora-to-peft` is a conversion workflow:
`megatron_gspo.megatron.io.lora_to_peft`."""

_ADAPTER_NAMES = ("LoraError", "LoraSettings", "target_of", "adapted_modules", "attach", "enabled",
                  "adapters_off", "is_adapter_name", "effective_weight", "is_adapted_weight",
                  "adapter_parameters", "sharded_state_dict", "load_sharded", "TARGETS")


def __getattr__(name: str):
    # `megatron_gspo.megatron.lora` was the adapters' module; its names live in `.adapters` now.
    if name in _ADAPTER_NAMES:
        raise ImportError(f"megatron_gspo.megatron.lora.{name} moved to "
                          f"megatron_gspo.megatron.lora.adapters.{name}: import that instead")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
