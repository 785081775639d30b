"""Command-line flags generated from the `GRPOConfig` fields, and one-line errors for every CLI."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from typing import Any

from mindrlhf.configs.grpo_configs import MOVED_FIELDS, PLAIN_FLAG_SECTION, RENAMED_FIELDS, SECTIONS, field_paths

logger = logging.getLogger("mindrlhf.configs")

_DEST_PREFIX = "cfg__"
_SHARED_PREFIX = "cfg_shared__"


def parse_bool(text: str) -> bool:
    """true/false (any case: MindRLHF's tutorials write True / False), 1/0, yes/no."""
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _flag_kwargs(annotation: Any) -> dict:
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        (item,) = typing.get_args(annotation)[:1] or (str,)
        return {"nargs": "*", "type": item if item in (int, float, str) else str}
    if annotation is bool:
        return {"type": parse_bool, "metavar": "{true,false}"}
    if annotation in (int, float, str):
        return {"type": annotation}
    return {"type": str}


class DeprecatedFlag(argparse.Action):
    """Stores like a plain flag and logs a warning naming the new spelling `new_flag`."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new_flag = new_flag

    def __call__(self, parser, namespace, values, option_string=None):
        logger.warning("%s is deprecated, use %s", option_string, self.new_flag)
        setattr(namespace, self.dest, values)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per GRPOConfig field, `--section.name`, and `--name`: for a name that several sections
    share (`seed`), `--name` sets it in all of them and `--section.name` in one (and wins), unless
    `PLAIN_FLAG_SECTION` gives `--name` to one section (`--learning_rate`: the optimizer's)."""
    hints = {section: typing.get_type_hints(cls) for section, cls in SECTIONS.items()}
    for name, places in field_paths().items():
        owner = places[0][0] if len(places) == 1 else PLAIN_FLAG_SECTION.get(name)
        if owner is None:
            sections = ", ".join(section for section, _ in places)
            parser.add_argument(f"--{name}", dest=f"{_SHARED_PREFIX}{name}", default=None,
                                help=f"[{sections}] sets {name} in each of these sections",
                                **_flag_kwargs(hints[places[0][0]][name]))
        for section, field in places:
            flags = [f"--{section}.{name}"]
            if section == owner:
                flags.insert(0, f"--{name}")
            group_help = field.metadata.get("help", "")
            parser.add_argument(*flags, dest=f"{_DEST_PREFIX}{section}__{name}", default=None,
                                help=f"[{section}] {group_help}", **_flag_kwargs(hints[section][name]))
    _add_old_flags(parser, hints)


def _add_old_flags(parser: argparse.ArgumentParser, hints: dict) -> None:
    """The flags of `MOVED_FIELDS` and (deprecated, with a warning) `RENAMED_FIELDS` at their old names."""
    taken = set(field_paths())
    for (old_section, old_name), (section, name) in {**MOVED_FIELDS, **RENAMED_FIELDS}.items():
        flags = [f"--{old_section}.{old_name}"] + ([f"--{old_name}"] if old_name not in taken else [])
        extra = {"action": DeprecatedFlag, "new_flag": f"--{section}.{name}"} \
            if (old_section, old_name) in RENAMED_FIELDS else {}
        parser.add_argument(*flags, dest=f"{_DEST_PREFIX}{section}__{name}", default=None,
                            help=f"{'deprecated ' if extra else ''}old name of --{section}.{name}",
                            **_flag_kwargs(hints[section][name]), **extra)


def config_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """`{section: {field: value}}` of the config flags given on the command line."""
    overrides: dict[str, dict[str, Any]] = {}
    places = field_paths()
    for dest, value in vars(args).items():
        if dest.startswith(_SHARED_PREFIX) and value is not None:
            name = dest[len(_SHARED_PREFIX):]
            for section, _ in places[name]:
                overrides.setdefault(section, {})[name] = value
    for dest, value in vars(args).items():
        if not dest.startswith(_DEST_PREFIX) or value is None:
            continue
        section, name = dest[len(_DEST_PREFIX):].split("__", 1)
        overrides.setdefault(section, {})[name] = value
    return overrides


def section_field_names() -> dict[str, list[str]]:
    """Section -> its field names (for docs and tests)."""
    return {section: [f.name for f in dataclasses.fields(cls)] for section, cls in SECTIONS.items()}
