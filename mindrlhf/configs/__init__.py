"""Configuration: dataclasses with help text and MindFormers-layout YAML loading."""
from mindrlhf.configs.base import ConfigError, from_mapping, get_section, help_field, load_yaml
from mindrlhf.configs.parallel import ParallelConfig

__all__ = ["ConfigError", "ParallelConfig", "from_mapping", "get_section", "help_field", "load_yaml"]
