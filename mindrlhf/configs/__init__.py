"""Configuration: dataclasses with help text and MindFormers-layout YAML loading."""
from mindrlhf.configs.base import ConfigError, field_help, from_mapping, get_section, help_field, load_yaml
from mindrlhf.configs.parallel import ParallelConfig

__all__ = ["ConfigError", "ParallelConfig", "field_help", "from_mapping", "get_section", "help_field", "load_yaml"]
