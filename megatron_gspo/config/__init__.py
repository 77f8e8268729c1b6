"""Configuration: typed sections (`sections`: one dataclass per YAML section), the root
`Config` with its cross-field checks and the YAML loader (`root`), the schema machinery behind
them (`schema`: documented fields, strict conversion from a dict, `a.b=c` overrides), and the
strict YAML loader (`yaml_strict`: duplicate keys and non-plain values are errors). Every
unknown or ignored key is an error naming its path."""

from megatron_gspo.config.root import Config, config_from_dict, load_config, save_config
from megatron_gspo.config.schema import ConfigError, describe, to_dict
from megatron_gspo.config.sections import LOSSES

__all__ = ["LOSSES", "Config", "ConfigError", "load_config", "save_config", "config_from_dict",
           "describe", "to_dict"]
